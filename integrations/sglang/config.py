"""What the front process tells SGLang's scheduler processes (torch-free, SGLang-free).

SGLang runs its scheduler (and with it the speculative worker that drafts) in processes of its
own, spawned by ``sglang.Engine``. The draft state therefore lives there: the suffix index, the
tenants' histories, the prediction documents of running requests and the workspace watchers.
The front process (``agentspec serve --backend sglang``) describes that state in a
``SchedulerConfig`` and puts it in the environment variable ``AGENTSPEC_SGLANG`` before it starts
the engine; every spawned SGLang process inherits it and the plugin's worker reads it.

Per request, the policy travels in SGLang's ``sampling_params["custom_params"]`` (flat keys:
SGLang allows only JSON scalars, lists of scalars or flat dicts there), built by
``request_params``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import msgspec

__all__ = ["ALGORITHM", "ENV", "HYBRID_ALGORITHM", "KEY_BUDGET", "KEY_DRAFTERS", "KEY_GREEDY", "KEY_PREDICTION",
           "KEY_SPEC", "KEY_TENANT", "SOURCE_KEY", "SchedulerConfig", "TenantWorkspace", "cache_salt", "read_request_greedy",
           "read_request_drafters", "read_request_params", "read_source_records", "request_params", "source_record"]

ALGORITHM = "AGENTSPEC"
"""The speculative algorithm name the plugin registers (``--speculative-algorithm AGENTSPEC``)."""
HYBRID_ALGORITHM = "AGENTSPEC_EAGLE3"
"""The hybrid: SGLang's EAGLE-3 worker whose steps may verify the suffix index's draft instead of the
head's (``--speculative-algorithm AGENTSPEC_EAGLE3``, with ``--speculative-draft-model-path``)."""
ENV = "AGENTSPEC_SGLANG"
"""The environment variable carrying the ``SchedulerConfig`` (JSON) into SGLang's processes."""

KEY_TENANT = "agentspec_tenant"
KEY_GREEDY = "agentspec_greedy"        # True: greedy (temperature 0), decided by the request, not guessed
KEY_SPEC = "agentspec_spec"            # False: speculation off (a root-only draft)
KEY_BUDGET = "agentspec_budget"        # max draft tokens (the verify width caps it)
KEY_PREDICTION = "agentspec_prediction"  # Predicted Outputs: token ids, a draft source for this request
KEY_DRAFTERS = "agentspec_drafters"    # the route's drafter list (the hybrid: "suffix", "eagle3", both)

SOURCE_KEY = "agentspec_steps"
"""The ``meta_info`` key (SGLang's per-token ``customized_info``) carrying per-step draft counts by
source back to the front: one entry per output token, the first token of each verify step holding
``"source:drafted:accepted,..."`` for that step (None elsewhere). ``read_source_records`` sums them."""


class TenantWorkspace(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One tenant and the folder indexed for it (None: no workspace)."""

    name: str
    workspace: str | None = None


class SchedulerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The draft state of each SGLang scheduler process.

    ``tokenizer``: a folder with ``tokenizer.json`` (the model's), to tokenize workspace files.
    ``tenants``: whose workspaces to index and watch (every process that drafts indexes them).
    ``watch``: keep workspaces current with a file watcher. ``history``: record each tenant's
    outputs as a draft source for its later requests. ``default_budget``: draft tokens for a
    request that names none (the verify width caps every draft). ``exclude``: the server's own
    files and folders as ``[rule, path]`` (its config file, log folder, caches), never indexed."""

    tokenizer: str | None = None
    tenants: list[TenantWorkspace] = []
    exclude: list[list[str]] = []
    watch: bool = True
    history: bool = True
    default_budget: int = 64

    def to_env(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_env(cls, environ: Any = None) -> "SchedulerConfig":
        raw = (os.environ if environ is None else environ).get(ENV)
        if not raw:
            return cls()
        return msgspec.json.decode(raw.encode(), type=cls)


def request_params(*, tenant: str = "default", spec: bool = True, greedy: bool = True,
                   budget: int | None = None, prediction: Sequence[int] | None = None,
                   drafters: Sequence[str] | None = None) -> dict[str, Any]:
    """The ``custom_params`` entries that carry one request's draft policy into the scheduler."""
    out: dict[str, Any] = {KEY_TENANT: str(tenant), KEY_SPEC: bool(spec), KEY_GREEDY: bool(greedy)}
    if budget is not None:
        out[KEY_BUDGET] = int(budget)
    if prediction:
        out[KEY_PREDICTION] = [int(t) for t in prediction]
    if drafters:
        out[KEY_DRAFTERS] = [str(d) for d in drafters]
    return out


def cache_salt(tenant: str) -> str:
    """SGLang's ``cache_salt`` for a tenant: its prefix-cache entries are keyed by it, so one
    tenant's prompts never hit another tenant's cached prefixes."""
    return f"agentspec-tenant:{tenant}"


def read_request_drafters(custom: Any) -> tuple[str, ...] | None:
    """The drafter list of a request's ``custom_params`` (None: the worker's default)."""
    if not isinstance(custom, dict):
        return None
    names = custom.get(KEY_DRAFTERS)
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        return None
    return tuple(names)


def source_record(counts: dict[str, tuple[int, int]]) -> str:
    """One step's ``{source: (drafted, accepted)}`` as its ``SOURCE_KEY`` entry."""
    return ",".join(f"{src}:{d}:{a}" for src, (d, a) in counts.items())


def read_source_records(values: Any) -> dict[str, list[int]]:
    """``{source: [steps, drafted, accepted]}`` summed over a request's ``SOURCE_KEY`` entries
    (anything malformed is skipped)."""
    out: dict[str, list[int]] = {}
    if not isinstance(values, list):
        return out
    for v in values:
        if not isinstance(v, str) or not v:
            continue
        for part in v.split(","):
            src, _, rest = part.rpartition(":")
            src, _, drafted = src.rpartition(":")
            try:
                d, a = int(drafted), int(rest)
            except ValueError:
                continue
            if not src:
                continue
            row = out.setdefault(src, [0, 0, 0])
            row[0] += 1
            row[1] += d
            row[2] += a
    return out


def read_request_greedy(custom: Any, sampling_params: Any) -> bool:
    """Whether a request is greedy: what its ``custom_params`` say (``request_params``); for a
    request from another client, SGLang's own normalisation (it makes a temperature-0 request
    ``top_k = 1``)."""
    if isinstance(custom, dict) and isinstance(custom.get(KEY_GREEDY), bool):
        return custom[KEY_GREEDY]
    return getattr(sampling_params, "top_k", 1) <= 1


def read_request_params(custom: Any) -> tuple[str, bool, int | None, list[int] | None]:
    """``(tenant, spec, budget, prediction)`` from a request's ``custom_params`` (None or foreign
    dicts: the defaults: tenant "default", speculation on)."""
    if not isinstance(custom, dict):
        return "default", True, None, None
    tenant = custom.get(KEY_TENANT)
    spec = custom.get(KEY_SPEC, True)
    budget = custom.get(KEY_BUDGET)
    pred = custom.get(KEY_PREDICTION)
    return (tenant if isinstance(tenant, str) and tenant else "default", spec is not False,
            budget if isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0 else None,
            [int(t) for t in pred] if isinstance(pred, list) and pred else None)
