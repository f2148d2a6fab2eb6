"""Configuration structs. Every field says why it exists."""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import msgspec

from .drafting.registry import drafter_names, parse_drafters
from .errors import ConfigError

__all__ = ["DEFAULT_SPEC", "RouteRule", "RouteWhen", "ServerConfig", "ServerSection", "SpecConfig", "TenantConfig", "UnknownField",
           "check_drafters", "load_server_config", "unknown_field"]


class SpecConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How one request speculates. ``spec=None`` on a request means plain decoding."""

    # Max draft tokens verified per step (tree nodes, root excluded). Rewrites copying a file pay
    # off with long drafts; the engine also caps it by the tokens still to generate.
    budget: int = 32
    # Stop a draft once the drafter's survival estimate for a token falls below this.
    min_prob: float = 0.0
    # Cost of one more verified token relative to a one-token step. Drafts are cut to the prefix
    # that maximises expected tokens per step cost (agentspec.drafting.draft.cut_for_cost), so
    # speculation does not make steps slower than it gains. None: the engine's own figure,
    # profiled at start-up (``engine.row_cost``); 0: always verify the whole draft.
    row_cost: float | None = None
    # Which drafters propose, by name (``agentspec.drafting.registry``; the same list a route's
    # ``drafters`` takes): e.g. ("suffix", "eagle3") is the suffix index backed by the EAGLE-3
    # head. None: the engine's own drafter. The engine builds each list once and reuses it
    # (drafters keep per-request state and share the suffix index across requests); an explicit
    # ``drafter=`` on the call wins. A list is stored as a tuple, so the config stays hashable.
    drafters: tuple[str, ...] | None = None
    # Where a request's grammar admits exactly one continuation (a fixed key, a closing brace or
    # tag), propose it as a draft too (verified like any other). False: the drafters' drafts alone.
    forced_drafts: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.forced_drafts, bool):
            raise ConfigError(f"SpecConfig.forced_drafts must be true or false, got {self.forced_drafts!r}")
        if not isinstance(self.budget, int) or isinstance(self.budget, bool) or self.budget < 0:
            raise ConfigError(f"SpecConfig.budget must be an int >= 0, got {self.budget!r}")
        if self.budget > 1024:
            raise ConfigError(f"SpecConfig.budget must be <= 1024, got {self.budget!r}")
        if self.row_cost is not None and (isinstance(self.row_cost, bool) or not isinstance(self.row_cost, (int, float))
                                          or not 0.0 <= self.row_cost <= 10.0):
            raise ConfigError(f"SpecConfig.row_cost must be None or a number in [0, 10], got {self.row_cost!r}")
        if not 0.0 <= float(self.min_prob) <= 1.0:
            raise ConfigError(f"SpecConfig.min_prob must be in [0, 1], got {self.min_prob!r}")
        if self.drafters is not None:
            msgspec.structs.force_setattr(self, "drafters", check_drafters(self.drafters, "SpecConfig.drafters"))


DEFAULT_SPEC = SpecConfig()   # a request's speculation when it names none


def check_drafters(names: object, what: str = "drafters") -> tuple[str, ...]:
    """``names`` checked against the drafter registry, as a tuple; ConfigError naming the bad
    value (unknown names list the known ones), so a typo fails where it is written."""
    if isinstance(names, str):
        names = (names,)
    if not isinstance(names, (list, tuple)):
        raise ConfigError(f"{what} must be a list of drafter names, got {names!r}")
    if not names:
        raise ConfigError(f"{what} must not be empty (None: the engine's own drafter; spec=None: no speculation)")
    try:
        parse_drafters(list(names))
    except ValueError as e:
        raise ConfigError(f"{what}: {e}") from None
    return tuple(names)


# ---------------------------------------------------------------------------------------------
# Server configuration: one TOML file (``agentspec serve --config FILE``); docs/configuration.md is
# generated from these structs and their comments (scripts/config_reference.py).

_NAME = r"^[A-Za-z0-9._-]{1,64}$"
Name = Annotated[str, msgspec.Meta(pattern=_NAME)]
ENDPOINTS = ("chat.completions", "completions", "apply", "messages", "responses")
DRAFTERS = drafter_names()   # the built-in drafters (agentspec.drafting.registry: the one list)


class ServerSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[server]``: logs, request limits, batching, the model and the prefix cache."""

    # where per-tenant acceptance logs go (<log_dir>/<tenant>.jsonl); relative to the working dir
    log_dir: str = "logs"
    # rotate a tenant's log when it grows past this many bytes
    log_max_bytes: Annotated[int, msgspec.Meta(ge=4096)] = 64 << 20
    # rotated logs kept per tenant (<tenant>.jsonl.1 is the newest); 0: none, the log starts over
    log_backups: Annotated[int, msgspec.Meta(ge=0, le=100)] = 5
    # request bodies larger than this are refused with 413
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 8 << 20
    # a request still running (queued or generating) after this many seconds is stopped
    request_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0
    # on SIGTERM / SIGINT: stop taking connections (new ones are refused, a request that still
    # arrives gets 503), let running requests finish for up to this many seconds, then cancel
    # the rest (their streams end with a 503 "shutting_down" error) and exit 0; a second signal
    # cancels at once. Keep it under the orchestrator's kill timeout (Kubernetes: 30 s)
    shutdown_grace_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 20.0
    # requests waiting for the engine beyond this many get 503 (the engine runs one at a time)
    max_queue: Annotated[int, msgspec.Meta(ge=1)] = 256
    # requests decoded together in one batch (continuous batching); more wait in the queue
    max_batch: Annotated[int, msgspec.Meta(ge=1, le=256)] = 16
    # how many draft tokens a batched step verifies: "load_aware" (global top-B survival slots under
    # the profiled step cost), "fixed" (each request's own cost cut) or "off" (plain batched decoding)
    budget_policy: Literal["load_aware", "fixed", "off"] = "load_aware"
    # max_tokens when a request gives none
    default_max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 1024
    # at most this many tenants get their own Prometheus label value; the rest share "(other)"
    metrics_max_tenants: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 32
    # operator keys for GET /metrics (Authorization: Bearer <key>): they read every tenant's series
    # and nothing else; a tenant's own key reads only that tenant's series. Each at least
    # MIN_API_KEY_CHARS (8) characters, none a tenant's key
    metrics_api_keys: list[str] = []
    # the checkpoint the embedded engine serves: a .gguf file or a Hugging Face folder (relative
    # paths from the working directory); `agentspec serve --model` overrides it; default: bundled
    model: str | None = None
    # the model id clients pass; default: the checkpoint's file or folder name
    model_name: str | None = None
    # memory for the embedded engine's prefix cache (prompt KV reused by requests sharing a
    # prefix: agent loops); unset: min(25% of RAM, 4 GiB); 0: off; less than one full-context
    # prompt's KV refuses to start
    prefix_cache_bytes: Annotated[int, msgspec.Meta(ge=0)] | None = None
    # one prefix cache for every tenant (shared system prompts); default one per tenant, so a
    # tenant's timing cannot probe another's prompts
    prefix_cache_shared: bool = False


MIN_API_KEY_CHARS = 8   # shorter API keys are refused at start-up
# an example config's keys copied as they are would leave a server open to anyone who read them
PLACEHOLDER_KEY_MARKS = ("change-me", "changeme", "replace-me", "replaceme", "your-key", "yourkey", "example-key",
                         "placeholder", "xxxxxxxx")
_KEY_HINT = "(e.g. `python -c \"import secrets; print('sk-' + secrets.token_urlsafe(24))\"`)"


def check_api_key(key: str, where: str) -> None:
    """Refuse a key that is too short or an example's placeholder (the key itself is never shown)."""
    if len(key) < MIN_API_KEY_CHARS:
        raise ConfigError(f"{where} is {len(key)} characters long; an API key needs at least {MIN_API_KEY_CHARS} "
                          f"{_KEY_HINT}")
    low = key.lower()
    mark = next((m for m in PLACEHOLDER_KEY_MARKS if m in low), None)
    if mark is not None:
        raise ConfigError(f"{where} is a placeholder (it contains {mark!r}): generate a key of your own {_KEY_HINT}")


class TenantConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[[tenants]]``, one table per tenant. With tenants configured every request needs an API key."""

    # tenant name: log file name and metrics label, so a restricted alphabet
    name: Name
    # bearer tokens that identify this tenant (Authorization: Bearer <key>); each at least
    # MIN_API_KEY_CHARS (8) characters, and no key listed twice
    api_keys: list[str] = []
    # repository this tenant's requests draft from and /v1/apply `path`s resolve in (default: --repo)
    workspace: str | None = None
    # generation requests running or queued at once; more get 429 with Retry-After (default: no cap)
    max_concurrent: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # generation requests started in any 60 s; more get 429 with Retry-After (default: no cap)
    requests_per_minute: Annotated[int, msgspec.Meta(ge=1)] | None = None

    def __post_init__(self) -> None:
        if self.name in (".", ".."):   # the name is a log file's name: <log_dir>/<name>.jsonl
            raise ConfigError(f"tenant name {self.name!r} is not allowed: a tenant's name names its log file; "
                              "use letters, digits, '.', '_' or '-', not '.' or '..' alone")
        for j, key in enumerate(self.api_keys):
            check_api_key(key, f"tenant {self.name!r}: api_keys[{j}]")


class RouteWhen(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A route's ``when``: every given condition must hold; a list matches any of its values."""

    # the endpoint: "chat.completions", "completions", "apply" (/v1/apply), "messages" (Anthropic's
    # /v1/messages) or "responses" (/v1/responses)
    endpoint: str | list[str] | None = None
    # the tenant's name (with tenants configured, one of theirs)
    tenant: str | list[str] | None = None
    # the model id the request names
    model: str | list[str] | None = None
    # requests whose temperature is at least this
    min_temperature: Annotated[float, msgspec.Meta(ge=0)] | None = None
    # requests whose temperature is at most this
    max_temperature: Annotated[float, msgspec.Meta(ge=0)] | None = None


class RouteRule(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A per-route rule: the first rule whose ``when`` matches a request decides how it speculates."""

    # shown in responses, logs and metrics
    name: Name
    # no `when`: the rule matches every request
    when: RouteWhen = msgspec.field(default_factory=RouteWhen)
    # false turns speculation off for matching requests (the reason is recorded)
    speculation: bool = True
    # max draft tokens per step (unset: SpecConfig's default, 32)
    budget: Annotated[int, msgspec.Meta(ge=0, le=1024)] | None = None
    # which drafters propose (names from agentspec.drafting.registry): "suffix" (the suffix index),
    # "json_copy" (text the server holds copied into a tool call's JSON strings, escaped; unset:
    # ["suffix", "json_copy"]), "lookahead" (the lookahead n-gram pool alone), "prompt_lookup", "eagle3" (the EAGLE-3 draft head over the
    # target's hidden states: `agentspec serve --eagle3 DIR`, $AGENTSPEC_EAGLE3, or the head shipped
    # for the bundled model), "draft_model" (a smaller model of the target's family: `agentspec serve
    # --draft-model FILE`; unset, with one loaded: ["suffix", "json_copy", "draft_model"]). Several
    # names: those drafters merged into one tree (["suffix", "lookahead"] is suffix + lookahead),
    # except that "eagle3" or "draft_model" beside others backs them: ["suffix",
    # "eagle3"] asks the head only when the suffix draft expects few accepted tokens, and verifies both
    # trees together. "a>b": drafter a backed by drafter b (b's draft is used when it expects more
    # accepted tokens). Each drafter at most once per route. A route's head is loaded and checked
    # against the model at server start-up: a missing or mismatched head refuses to start.
    drafters: list[str] | None = None
    # where a request's grammar (tool calls, a response schema) forces the next tokens, propose
    # them as a draft (verified like any other); false: only the drafters propose
    forced_drafts: bool = True

    def __post_init__(self) -> None:
        for field, values in (("endpoint", self.when.endpoint),):
            for v in [values] if isinstance(values, str) else values or []:
                if v not in ENDPOINTS:
                    raise ConfigError(f"route {self.name!r}: when.{field} {v!r} is not one of {list(ENDPOINTS)}")
        if self.drafters is not None and not self.drafters:
            raise ConfigError(f"route {self.name!r}: drafters must not be empty (use speculation = false)")
        if self.drafters:
            try:
                parse_drafters(self.drafters)
            except ValueError as e:  # names the bad value and lists the known drafters
                raise ConfigError(f"route {self.name!r}: {e}") from None


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The whole file: ``[server]``, ``[[tenants]]`` and ``[[routes]]``; every key is optional."""

    # how the server runs
    server: ServerSection = msgspec.field(default_factory=ServerSection)
    # no tenants: one tenant "default" and no API key (loopback only)
    tenants: list[TenantConfig] = []
    # per-route speculation rules, first match wins; no match: route "default" (speculation on)
    routes: list[RouteRule] = []

    def __post_init__(self) -> None:
        names = [t.name for t in self.tenants]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ConfigError(f"tenant names must be unique, repeated: {sorted(dup)}")
        first: dict[str, str] = {}   # key -> where it is first listed (the key itself is never shown)
        for j, k in enumerate(self.server.metrics_api_keys):
            at = f"server.metrics_api_keys[{j}]"
            check_api_key(k, at)
            if k in first:
                raise ConfigError(f"an API key is listed twice: {at} repeats {first[k]}")
            first[k] = at
        for i, t in enumerate(self.tenants):
            for j, k in enumerate(t.api_keys):
                at = f"tenants[{i}].api_keys[{j}] (tenant {t.name!r})"
                if k in first:
                    raise ConfigError(f"an API key is listed for more than one tenant (or twice): {at} "
                                      f"repeats {first[k]}")
                first[k] = at
        routes = [r.name for r in self.routes]
        dup = {n for n in routes if routes.count(n) > 1}
        if dup:
            raise ConfigError(f"route names must be unique, repeated: {sorted(dup)}")
        for r in self.routes:
            ts = r.when.tenant
            for t in [ts] if isinstance(ts, str) else ts or []:
                if self.tenants and t not in names:
                    raise ConfigError(f"route {r.name!r}: when.tenant {t!r} is not a configured tenant")


class UnknownField(NamedTuple):
    """A key that a strictly decoded object does not take (``unknown_field``)."""

    name: str                 # the unknown key
    where: str                # the object holding it, as a path from the root ("" = the root; "routes[0].when")
    valid: tuple[str, ...]    # the keys that object takes, in declaration order
    suggestion: str | None    # the valid key closest to ``name`` (a likely typo), if any

    @property
    def path(self) -> str:
        """The unknown key's own path (``routes[0].when.endpoints``)."""
        return f"{self.where}.{self.name}" if self.where else self.name

    def hint(self, noun: str = "keys") -> str:
        """``did you mean `x`? `` (when a key is close) and the valid keys, for a message."""
        mean = f"did you mean `{self.suggestion}`? " if self.suggestion else ""
        return f"{mean}valid {noun}: {', '.join(self.valid)}"


_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]*)`(?: - at `\$(?P<path>[^`]*)`)?$")
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def unknown_field(error: msgspec.ValidationError, root: Any) -> UnknownField | None:
    """What ``msgspec`` refused in ``error`` if it is an unknown field of a ``forbid_unknown_fields``
    Struct reached from the type ``root``: the key, the object holding it and that object's
    keys; None for any other error."""
    m = _UNKNOWN.match(str(error))
    if m is None:
        return None
    path = m["path"] or ""
    info: Any = msgspec.inspect.type_info(root)
    for name, index in _STEP.findall(path):
        info = _member(info, list_step=bool(index))
        if info is None:
            return None
        if index:
            info = info.item_type
        elif isinstance(info, msgspec.inspect.DictType):
            info = info.value_type
        else:
            info = next((f.type for f in info.fields if f.encode_name == name), None)
            if info is None:
                return None
    info = _member(info, list_step=False)
    if not isinstance(info, msgspec.inspect.StructType):
        return None
    valid = tuple(f.encode_name for f in info.fields)
    close = difflib.get_close_matches(m["name"], valid, n=1, cutoff=0.6)
    return UnknownField(m["name"], path.lstrip("."), valid, close[0] if close else None)


def _member(info: Any, *, list_step: bool) -> Any:
    """``info`` (or the member of a union) that a path step goes into: a list for ``[i]``, an
    object (struct or dict) for ``.name``."""
    kinds = ((msgspec.inspect.ListType, msgspec.inspect.VarTupleType, msgspec.inspect.SetType) if list_step
             else (msgspec.inspect.StructType, msgspec.inspect.DictType))
    for t in (info.types if isinstance(info, msgspec.inspect.UnionType) else (info,)):
        if isinstance(t, kinds):
            return t
    return None


def _table(where: str) -> str:
    """A TOML table's name for a message: ``[server]``, ``routes[0].when``, the top level."""
    if not where:
        return "at the top level"
    return f"in [{where}]" if "[" not in where else f"in {where}"


def load_server_config(path: str | os.PathLike | None) -> ServerConfig:
    """Read and validate a server TOML file; None gives the defaults. Errors name the field."""
    if path is None:
        return ServerConfig()
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(path)!r}: {e.strerror or e}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    try:
        return msgspec.convert(data, ServerConfig)
    except msgspec.ValidationError as e:
        bad = unknown_field(e, ServerConfig)
        if bad is not None:   # a typo or a key of another table: name it and list what that table takes
            raise ConfigError(f"config file {str(path)!r}: unknown key `{bad.name}` {_table(bad.where)}; "
                              f"{bad.hint()}") from None
        raise ConfigError(f"config file {str(path)!r}: {e}") from None
