"""The seam between the server and an engine: a typed request and the ``Backend`` protocol.

The request layer (``agentspec.api``, under the server and the SDK) talks to a ``Backend`` and to
nothing else: it turns a request body into token ids with the backend's tokenizer and chat
template, builds a ``GenerationRequest`` and submits it; committed tokens and the final ``Generation`` come back
through callbacks. Everything engine-specific (the batch scheduler, drafters, the KV cache,
prediction documents in the draft index) stays behind the protocol. The embedded torch engine
is the first implementation (``agentspec.backends.embedded.backend.EmbeddedBackend``); an SGLang backend
is the second.

This module is torch-free: it imports msgspec, the standard library and agentspec's config,
errors and result structs only.
"""

from __future__ import annotations

import operator
import queue
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import msgspec

from ..decode.results import Generation
from ..config import SpecConfig
from ..errors import ContextLengthError, InvalidRequestError, QueueFullError

__all__ = ["MAX_TEMPERATURE", "Backend", "model_name_for", "ContextLengthError", "GenerationRequest", "InvalidRequestError", "OnDone",
           "OnTokens", "OutputFormat", "QueueFullError", "Sampling", "TokenizerLike", "check_drafter_names", "check_float", "check_int",
           "check_messages", "check_request", "check_sampling", "check_token_ids", "collect", "request_drafters",
           "stream_via_submit"]


def model_name_for(model: str | Path | None) -> str:
    """The model id a server reports for a model path (None: the bundled model), whichever backend
    runs it."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    p = Path(model)
    return p.name.removesuffix(".gguf") if p.suffix == ".gguf" else p.name

MAX_TEMPERATURE = 2.0   # the OpenAI range, [0, 2], for the API and the engine alike
# a positive temperature under this samples as greedy (temperature 0): dividing logits by a
# temperature near 0 (1e-320) overflows them to inf and the softmax to NaN; at 1e-5 a logit gap of
# 0.001 is already a factor e^-100, so sampling is the argmax but for near-exact ties
GREEDY_BELOW = 1e-5

OnTokens = Callable[[list[int]], None]
"""Called with the tokens each scheduler step committed (from the backend's scheduler thread)."""
OnDone = Callable[[Any, Any], None]
"""Called once at the end: ``(generation, None)`` or ``(None, error)`` (from the scheduler thread).
A cancelled request ends with a ``Generation`` whose finish_reason is "cancelled"."""


class OutputFormat(msgspec.Struct, frozen=True, kw_only=True):
    """How a request's output reads, for drafters that draft from its structure (a tool call's
    JSON arguments): ``tool_format``, the model's tool-call row (``agentspec.chat.formats.FORMATS``
    name; None: no tools offered), ``tools`` the names a call may take, ``forced`` a call is forced
    (``tool_choice`` required or named), ``json`` the whole answer is one JSON value (a response
    schema). It never changes what is generated: it only tells drafters where to look."""

    tool_format: str | None = None
    tools: tuple[str, ...] = ()
    forced: bool = False
    json: bool = False


class GenerationRequest(msgspec.Struct, kw_only=True):
    """One generation, as the request layer (``agentspec.api``) hands it to a backend.

    ``prompt_ids``: the prompt's token ids (chat template already applied where wanted).
    ``spec``: how the request speculates; None is plain decoding. ``drafters``: the drafter names
    of the request's route (``agentspec.drafting.registry``), None for the backend's default (the
    embedded engine's ``DEFAULT_DRAFTERS``; on SGLang, what its algorithm drafts with); a
    ``spec.drafters`` of its own overrides them. ``tenant`` scopes drafting (its workspace, its history, its predictions).
    ``request_id``: the id ``cancel`` takes ("" : the backend assigns one and ``submit`` returns
    it). ``prediction_ids``: tokens the client predicts the output to contain; the backend makes
    them a draft source for this request only (within its tenant) and drops them at its end.
    ``grammar``: constrain the output to an llguidance grammar (what ``llguidance.LLMatcher.
    grammar_from_json_schema`` / ``grammar_from_lark`` return, or Lark text): every token is the
    one plain decoding picks among the tokens the grammar allows, with speculation or without.
    ``output``: how the output reads (``OutputFormat``; None: free text), for drafters.

    A backend checks a request once, where it is submitted (``check_request``), and hands the
    checked one on: nothing behind ``submit`` checks it again."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = []
    spec: SpecConfig | None = SpecConfig()
    drafters: tuple[str, ...] | None = None
    tenant: str = "default"
    request_id: str = ""
    prediction_ids: list[int] | None = None
    grammar: str | None = None
    output: OutputFormat | None = None

    @property
    def greedy(self) -> bool:
        """Greedy decoding (the target's argmax), decided by the temperature alone: 0 is greedy."""
        return self.temperature <= 0

    @property
    def drafter_names(self) -> tuple[str, ...] | None:
        """The drafters it drafts with: its own ``spec.drafters`` when set, over its route's (None:
        the backend's default)."""
        spec = self.spec
        if spec is not None and spec.drafters is not None:
            return tuple(spec.drafters)
        return None if self.drafters is None else tuple(self.drafters)


@runtime_checkable
class TokenizerLike(Protocol):
    """What the server needs of a backend's tokenizer."""

    eos_token_ids: frozenset[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@runtime_checkable
class Backend(Protocol):
    """What the server needs of an engine. Implementations: ``agentspec.backends.embedded.backend.EmbeddedBackend``."""

    model_name: str          # the model id the server reports (``/v1/models``)
    max_context: int         # tokens: prompt + completion

    @property
    def tokenizer(self) -> TokenizerLike: ...

    @property
    def index(self) -> Any:
        """The draft index tenants' workspace documents go into (a ``SuffixIndex``), or None when
        the backend drafts without workspaces."""
        ...

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of chat messages (``{"role", "content"}``; an assistant turn's ``tool_calls``
        and ``reasoning_content``, a ``role: tool`` result with its ``tool_call_id``, as
        transformers' ``apply_chat_template`` takes them) and ``tools`` (OpenAI function tools) with
        the model's chat template and the generation prompt; ``template_kwargs``: the template's own
        variables (``enable_thinking``). Raises InvalidRequestError naming the bad value."""
        ...

    def encode_text(self, text: str) -> list[int]:
        """Token ids of raw text: no template, no special tokens."""
        ...

    def submit(self, request: GenerationRequest, *, on_tokens: OnTokens, on_done: OnDone,
               should_stop: Callable[[], bool] | None = None) -> str:
        """Queue a request; returns its id. Bad input raises here (InvalidRequestError,
        ContextLengthError, with ``param``); a full queue raises QueueFullError. ``should_stop``
        is polled between steps: True ends the request with finish_reason "cancelled"."""
        ...

    def stream(self, request: GenerationRequest) -> Iterator[list[int]]:
        """Run a request from synchronous code: yields the committed tokens of each step and
        returns the ``Generation`` (``StopIteration.value``). Bad input raises at the call."""
        ...

    def cancel(self, request_id: str) -> bool:
        """Stop a queued or running request at the next step; False when no such request runs."""
        ...

    def health(self) -> dict[str, Any]:
        """``{"status": "ok" | ..., "running": int, "waiting": int}``."""
        ...

    def stats(self) -> dict[str, Any]:
        """What runs (hardware, kernels), the scheduler's step-cost source, request counts."""
        ...

    def memory(self) -> dict[str, int]:
        """Bytes held in this process by what grows with use: ``index_bytes`` (the draft index),
        ``prefix_cache_bytes``; only the ones this backend has (``/health``)."""
        ...

    def run(self, on_ready: Callable[[], None] | None = None) -> None:
        """Run the scheduler on the calling thread until ``close()`` (from another thread).
        ``on_ready()`` is called once it takes requests (on this thread, before blocking)."""
        ...

    def close(self) -> None:
        """Stop: queued requests fail, running ones end; ``run()`` returns. Idempotent."""
        ...


_END = object()


def stream_via_submit(backend: Backend, request: GenerationRequest) -> Iterator[list[int]]:
    """``Backend.stream`` on top of ``submit``: the callbacks feed a queue this generator reads.
    Submits at once (bad input raises here, not at the first ``next()``); closing the generator
    early cancels the request."""
    q: queue.SimpleQueue = queue.SimpleQueue()

    def on_done(gen: Any, err: Any) -> None:
        q.put((_END, gen, err))

    rid = backend.submit(request, on_tokens=q.put, on_done=on_done)

    def run() -> Iterator[list[int]]:
        finished = False
        try:
            while True:
                item = q.get()
                if isinstance(item, tuple) and item and item[0] is _END:
                    finished = True
                    _, gen, err = item
                    if err is not None:
                        raise err
                    return gen
                yield item
        finally:
            if not finished:
                backend.cancel(rid)

    return run()


def collect(stream: Iterator[list[int]]) -> Generation:
    """Drain a ``Backend.stream`` generator; its ``Generation``."""
    while True:
        try:
            next(stream)
        except StopIteration as done:
            return done.value


def check_messages(messages: Any) -> list[dict]:
    """Chat messages checked (a non-empty list of ``{"role": str, "content": str, ...}``) and
    copied to plain dicts; InvalidRequestError (param "messages") naming what is wrong."""
    if isinstance(messages, (str, bytes, bytearray, Mapping)):
        raise InvalidRequestError(f"messages must be a list of messages, got {type(messages).__name__}",
                                  param="messages")
    try:
        items = list(messages)
    except TypeError:
        raise InvalidRequestError(f"messages must be a list of messages, got {type(messages).__name__}",
                                  param="messages") from None
    if not items:
        raise InvalidRequestError("messages must not be empty", param="messages")
    for i, m in enumerate(items):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidRequestError(f"messages[{i}] needs string 'role' and 'content', got {m!r}",
                                      param="messages")
    return [dict(m) for m in items]


def check_int(name: str, value: Any, *, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as an int in [lo, hi]; InvalidRequestError with ``param=name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param=name)
    if lo is not None and value < lo:
        raise InvalidRequestError(f"{name} must be >= {lo}, got {value}", param=name)
    if hi is not None and value > hi:
        raise InvalidRequestError(f"{name} must be <= {hi}, got {value}", param=name)
    return value


def check_float(name: str, value: Any, *, lo: float, hi: float) -> float:
    """``value`` as a float in [lo, hi] (NaN refused); InvalidRequestError with ``param=name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}", param=name)
    v = float(value)
    if not (lo <= v <= hi):  # also rejects NaN
        raise InvalidRequestError(f"{name} must be in [{lo}, {hi}], got {value!r}", param=name)
    return v


# ---- request checks: one implementation for every backend and the engine's own API ----------------

def check_token_ids(ids: Any, *, vocab_size: int, name: str = "prompt", param: str = "prompt",
                    empty_ok: bool = False) -> list[int]:
    """``ids`` as a list of ints in ``[0, vocab_size)``; InvalidRequestError (``param``) naming
    the first bad one and its index in ``name``."""
    if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, Sequence):
        raise InvalidRequestError(f"{name} must be a list of token ids, got {type(ids).__name__}", param=param)
    if not ids and not empty_ok:
        raise InvalidRequestError(f"{param} must not be empty", param=param)
    out = []
    for i, t in enumerate(ids):
        try:
            v = None if isinstance(t, (bool, float)) else operator.index(t)
        except TypeError:
            v = None
        if v is None:
            raise InvalidRequestError(f"token id at index {i} of {name} must be an integer, got {t!r}", param=param)
        if not 0 <= v < vocab_size:
            raise InvalidRequestError(f"token id {v} at index {i} of {name} is out of the vocabulary "
                                      f"[0, {vocab_size})", param=param)
        out.append(v)
    return out


class Sampling(msgspec.Struct, frozen=True):
    """A request's checked decoding options."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stops: list[str]


def check_sampling(*, max_tokens: Any, temperature: Any = 0.0, top_p: Any = 1.0, top_k: Any = 0, seed: Any = None,
                   stop: Any = None, spec: Any = None) -> Sampling:
    """The decoding options of one request checked (InvalidRequestError naming the bad value) and
    normalised; ``spec`` must be a ``SpecConfig`` or None."""
    from ..text import check_stop

    check_int("max_tokens", max_tokens, lo=1)
    temperature = check_float("temperature", temperature, lo=0.0, hi=MAX_TEMPERATURE)
    if temperature < GREEDY_BELOW:   # greedy: logits / 1e-320 are infinite, the softmax NaN
        temperature = 0.0
    top_p = check_float("top_p", top_p, lo=0.0, hi=1.0)
    if top_p == 0.0:
        raise InvalidRequestError("top_p must be in (0, 1], got 0", param="top_p")
    check_int("top_k", top_k, lo=0)
    if seed is not None:
        check_int("seed", seed, lo=-(2**63), hi=2**64 - 1)
    if spec is not None and not isinstance(spec, SpecConfig):
        raise InvalidRequestError(f"spec must be a SpecConfig or None, got {type(spec).__name__}", param="spec")
    stops = check_stop(stop)
    return Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stops=stops)


def check_drafter_names(names: Sequence[str] | str) -> tuple[str, ...]:
    """A drafter list (``agentspec.drafting.registry``) as a tuple; unknown names are the
    request's fault: InvalidRequestError (param "drafters") listing the known ones."""
    from ..drafting.registry import parse_drafters

    key = (names,) if isinstance(names, str) else tuple(names)
    try:
        parse_drafters(key)
    except (ValueError, KeyError) as e:
        raise InvalidRequestError(str(e).strip("'\""), param="drafters") from None
    return key


def request_drafters(request: GenerationRequest) -> tuple[str, ...] | None:
    """The drafter list ``request`` drafts with, checked (``GenerationRequest.drafter_names``;
    None: the backend's default)."""
    names = request.drafter_names
    return None if names is None else check_drafter_names(names)


def check_request(request: Any, *, vocab_size: int, max_context: int,
                  max_prompt: int | None = None) -> GenerationRequest:
    """The one check of a request, where a backend takes it (``Backend.submit``): its type, the
    prompt's and the prediction's token ids, the sampling options, the drafter names and the
    context window (``max_prompt``: a shorter limit on the prompt alone, where the backend has
    one). Raises InvalidRequestError / ContextLengthError naming the bad value (``param``);
    returns the request normalised (lists of ints, the stop list, the drafter names resolved
    into ``drafters``), which nothing behind ``submit`` checks again."""
    if not isinstance(request, GenerationRequest):
        raise InvalidRequestError(f"request must be a GenerationRequest, got {type(request).__name__}",
                                  param="request")
    ids = check_token_ids(request.prompt_ids, vocab_size=vocab_size, name="prompt", param="prompt")
    v = check_sampling(max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
                       top_k=request.top_k, seed=request.seed, stop=request.stop, spec=request.spec)
    drafters = request_drafters(request)
    if request.grammar is not None and (not isinstance(request.grammar, str) or not request.grammar.strip()):
        raise InvalidRequestError(f"grammar must be a non-empty string (an llguidance grammar), got "
                                  f"{request.grammar!r:.80}", param="grammar")
    if request.output is not None and not isinstance(request.output, OutputFormat):
        raise InvalidRequestError(f"output must be an OutputFormat, got {type(request.output).__name__}",
                                  param="output")
    prediction = None
    if request.prediction_ids is not None:
        prediction = check_token_ids(request.prediction_ids, vocab_size=vocab_size, name="prediction_ids",
                                     param="prediction_ids", empty_ok=True) or None
    if max_prompt is not None and len(ids) > max_prompt:
        raise ContextLengthError(f"prompt of {len(ids)} tokens exceeds the {max_prompt} tokens this server takes "
                                 f"(context window {max_context})", param="prompt")
    if len(ids) + v.max_tokens > max_context:
        raise ContextLengthError(
            f"prompt of {len(ids)} tokens plus max_tokens={v.max_tokens} exceeds the context window of "
            f"{max_context} tokens", param="max_tokens" if len(ids) < max_context else "prompt")
    return msgspec.structs.replace(request, prompt_ids=ids, temperature=v.temperature, top_p=v.top_p, top_k=v.top_k,
                                   seed=v.seed, stop=v.stops, drafters=drafters, prediction_ids=prediction)
