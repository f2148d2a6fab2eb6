"""``SGLangBackend``: an in-process ``sglang.Engine`` behind the ``agentspec.backends.protocol.Backend`` protocol.

SGLang runs its scheduler (and with it the speculative worker that drafts) in processes it
spawns; the ``sglang.Engine`` object lives in this process and talks to them through its
tokenizer manager, an asyncio object. This backend owns:

* the engine's start (``sglang.Engine(**server_args)``) with the speculative algorithm asked for:
  ``"agentspec"`` (default: SGLang's ``speculative_algorithm="AGENTSPEC"``, the worker of
  ``agentspec.integrations.sglang`` drafting from the suffix index inside the scheduler process),
  ``"ngram"`` (SGLang's own NGRAM, a peer baseline), ``"eagle3"`` (SGLang's EAGLE3 with a draft
  head folder) or None (plain decoding). The scheduler-side draft state (tenants' workspaces,
  histories, predictions) is described by an ``integrations.sglang.config.SchedulerConfig`` put in
  ``$AGENTSPEC_SGLANG`` before the engine starts, so the spawned processes inherit it; there is
  no front-process index (``index`` is None);
* an asyncio event loop on a thread of its own that drives every request
  (``engine.async_generate(input_ids=..., stream=True, rid=...)``) and polls ``should_stop``;
* the tokenizer and chat template (agentspec's ``Tokenizer`` over the model folder: the text a
  request returns is decoded here, as the embedded backend decodes it, not by SGLang), request
  validation (the embedded backend's rules and messages), the context length and the model name.

How SGLang 0.5.23 streams (``TokenizerManager._handle_batch_output`` / ``_wait_one_response``):
each chunk is ``{"text", "output_ids", "meta_info"}``. Without ``incremental_streaming_output``
(the default) ``output_ids`` is cumulative (intermediate chunks even share one growing list), so
the new tokens of a chunk are the ones past those already seen; with it, each chunk carries only
its own tokens. ``meta_info["finish_reason"]`` is None until the end, then a dict: ``{"type":
"stop", "matched": <token id or stop string>}``, ``{"type": "length", "length": n}`` or
``{"type": "abort", "message", "status_code", "err_type"}``. A stop on a token (EOS) leaves that
token at the end of ``output_ids``: it is dropped here (the embedded backend reports no EOS). A
stop string leaves the tokens through the one that completed it (as the embedded backend); the
text is cut before it. The final ``meta_info`` has ``prompt_tokens``, ``completion_tokens``,
``cached_tokens``, ``e2e_latency`` and, with a speculative algorithm, ``spec_verify_ct``,
``spec_accept_length`` (completion tokens per verify step), ``spec_accept_rate``,
``spec_num_correct_drafts``, ``spec_num_proposed_drafts`` (verify steps x (draft tokens - 1)),
``spec_correct_drafts_histogram`` (steps by accepted draft tokens) and more, read defensively
(names drift between SGLang versions). Cancelling the task that iterates the stream makes
SGLang's generator abort the request in the scheduler (``_release_req_states_on_failure`` ->
``abort_request(rid)``).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from agentspec.backends.files import read_json_object
from agentspec.backends.protocol import (
    GenerationRequest,
    OnDone,
    OnTokens,
    check_messages,
    check_request,
    stream_via_submit,
)
from agentspec.errors import (
    BackendClosedError,
    ConfigError,
    InvalidRequestError,
    ModelLoadError,
    QueueFullError,
)
from agentspec.text import stop_index
from agentspec.decode.results import Generation, GenerationStats

__all__ = ["ALGORITHMS", "SGLangBackend", "check_route_drafters", "sglang_available"]

ALGORITHMS = {"agentspec": "AGENTSPEC", "ngram": "NGRAM", "eagle3": "EAGLE3", "hybrid": "AGENTSPEC_EAGLE3"}
"""``speculative`` choices -> SGLang's ``speculative_algorithm`` (None: no speculation)."""

# the route drafter names each algorithm stands for (see ``check_route_drafters``)
_PROVIDES = {"agentspec": frozenset({"suffix"}), "eagle3": frozenset({"eagle3"}),
             "hybrid": frozenset({"suffix", "eagle3"})}
# the policy-carrying algorithms: per-request custom_params (tenant, speculation off, budget, ...)
_POLICY = frozenset({"agentspec", "hybrid"})

_ids = itertools.count()
_RAW_SPEC_KEEP = 256   # raw SGLang spec fields kept for the last requests (``spec_meta``)


def sglang_available() -> bool:
    """True when ``sglang`` can be imported here (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


def check_route_drafters(speculative: str | None, drafters: Mapping[str, Sequence[str]]) -> None:
    """The drafter lists of a server's routes against the SGLang backend's one algorithm.

    With SGLang, one speculative algorithm drafts for every request of the server; a route can
    turn speculation off (``speculation = false``, budget) but cannot choose drafters. So:
    ``"agentspec"`` stands for "suffix" (the AGENTSPEC worker drafts from the suffix index:
    workspaces, tenant history, the request's prediction), ``"eagle3"`` for "eagle3"; a route
    naming anything else is a ``ConfigError`` naming the route (its drafters need the embedded
    backend). With ``"ngram"`` and None (baselines) route drafter lists are ignored: NGRAM drafts
    for every request, None for none."""
    provides = _PROVIDES.get(speculative or "")
    if provides is None:
        return
    for label, names in drafters.items():
        shown = [names] if isinstance(names, str) else list(names)
        flat = {n for entry in shown for n in str(entry).split(">")}
        bad = sorted(flat - provides)
        if bad:
            hint = (" (with --speculative eagle3, SGLang's EAGLE3 drafts for every request)" if "eagle3" in bad
                    else "")
            raise ConfigError(
                f"{label}: drafters {shown}: {', '.join(map(repr, bad))} only run on the embedded backend; "
                f"with --backend sglang --speculative {speculative}, routes may name only "
                f"{sorted(provides)}{hint}")


class _Req:
    """One request in flight (touched on the backend's event loop, except the cancel flag)."""

    __slots__ = ("rid", "request", "ids", "sampling", "on_tokens", "on_done", "should_stop", "task",
                 "cancel_requested", "out", "seen", "t0", "t_first", "meta", "done", "spec_on")

    def __init__(self, rid: str, request: GenerationRequest, ids: list[int], sampling: dict, on_tokens: OnTokens,
                 on_done: OnDone, should_stop: Callable[[], bool] | None, spec_on: bool) -> None:
        self.rid = rid
        self.request = request
        self.ids = ids
        self.sampling = sampling
        self.on_tokens = on_tokens
        self.on_done = on_done
        self.should_stop = should_stop
        self.task: asyncio.Task | None = None
        self.cancel_requested = False
        self.out: list[int] = []       # committed completion tokens (EOS excluded)
        self.seen = 0                  # output ids of SGLang's cumulative stream consumed so far
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.meta: dict = {}
        self.done = False
        self.spec_on = spec_on


class SGLangBackend:
    """An in-process ``sglang.Engine`` as a ``Backend``.

    ``model``: a Hugging Face model folder (``config.json`` and ``tokenizer.json``).
    ``tenants``: tenant name -> its workspace folder (None: none), for the scheduler's draft
    index; ``watch``/``history``/``default_budget`` go into the ``SchedulerConfig`` too.
    ``speculative``: "agentspec" (default), "ngram", "eagle3" (``eagle3``: the head folder) or
    None. ``draft_tokens``: SGLang's ``speculative_num_draft_tokens`` (the verify width).
    ``tp_size``, ``dp_size``, ``device``, ``dtype``, ``attention_backend``,
    ``mem_fraction_static``, ``max_total_tokens``, ``max_running_requests``,
    ``context_length``: the SGLang server arguments of those names (None: SGLang's default);
    ``engine_kwargs``: any other ``sglang.Engine`` keyword arguments (they win). ``max_queue``:
    requests in flight beyond ``max_running_requests`` (when known) raise QueueFullError.
    ``drafters``: the drafter lists of the server's routes, by label, checked against the
    algorithm before the engine starts (``check_route_drafters``). ``engine``: an engine already
    started (tests); then no engine is started here and the ``SchedulerConfig`` is not set.

    The engine starts in the constructor, on the calling thread (SGLang installs its SIGQUIT
    handler from the main thread); its worker processes are spawned, so a script that builds one
    needs an ``if __name__ == "__main__":`` guard."""

    def __init__(self, model: str | os.PathLike, *, tenants: Mapping[str, str | os.PathLike | None] | None = None,
                 watch: bool = True, history: bool = True, default_budget: int = 64,
                 model_name: str | None = None, speculative: str | None = "agentspec", draft_tokens: int = 8,
                 eagle3: str | os.PathLike | None = None, tp_size: int = 1, dp_size: int = 1,
                 device: str | None = None, dtype: str | None = None, attention_backend: str | None = None,
                 mem_fraction_static: float | None = None, max_total_tokens: int | None = None,
                 max_running_requests: int | None = None, context_length: int | None = None,
                 engine_kwargs: Mapping[str, Any] | None = None, max_queue: int = 256,
                 drafters: Mapping[str, Sequence[str]] | None = None, engine: Any = None,
                 quiet: bool = False, exclude: Sequence[tuple[str, str]] = ()) -> None:
        from agentspec.backends.protocol import model_name_for
        from agentspec.backends.tokenizer import Tokenizer

        if speculative is not None and speculative not in ALGORITHMS:
            raise ConfigError(f"speculative must be one of {sorted(ALGORITHMS)} or None, got {speculative!r}")
        for name, value, lo in (("tp_size", tp_size, 1), ("dp_size", dp_size, 1), ("draft_tokens", draft_tokens, 2),
                                ("max_queue", max_queue, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ConfigError(f"{name} must be an integer >= {lo}, got {value!r}")
        root = Path(model)
        if root.suffix == ".gguf" or not root.is_dir():
            raise ConfigError(f"the SGLang backend needs a Hugging Face model folder, got {str(model)!r}")
        for need in ("config.json", "tokenizer.json"):
            if not (root / need).is_file():
                raise ConfigError(f"model folder {str(root)!r} has no {need}")
        if speculative in ("eagle3", "hybrid"):
            if eagle3 is None:
                raise ConfigError(f"speculative {speculative!r} needs the EAGLE-3 head folder (--eagle3 DIR)")
            if not (Path(eagle3) / "config.json").is_file():
                raise ConfigError(f"EAGLE-3 head folder {str(eagle3)!r} has no config.json")
        check_route_drafters(speculative, drafters or {})

        self.model_path = root.resolve()
        self.model_name = model_name or model_name_for(root)
        self.speculative = speculative
        self.algorithm = ALGORITHMS.get(speculative) if speculative else None
        self.draft_tokens = draft_tokens
        self.tp_size = tp_size
        self.dp_size = dp_size
        self.max_queue = max_queue
        self.quiet = quiet
        try:
            self._tokenizer = Tokenizer.load(self.model_path)
        except Exception as e:  # noqa: BLE001 - a bad tokenizer.json, missing files
            raise ModelLoadError(f"cannot load the tokenizer of {str(root)!r}: {e}") from e
        model_cfg = read_json_object(self.model_path / "config.json")
        vocab = model_cfg.get("vocab_size")
        self._vocab_size = int(vocab) if isinstance(vocab, int) and vocab > 0 else self._tokenizer.vocab_size
        self._eos = sorted(self._tokenizer.eos_token_ids)

        from agentspec.integrations.sglang.config import ENV, SchedulerConfig, TenantWorkspace

        self.scheduler_config = SchedulerConfig(
            tokenizer=str(self.model_path), watch=watch, history=history, default_budget=default_budget,
            tenants=[TenantWorkspace(name=n, workspace=None if w is None else str(Path(w).resolve()))
                     for n, w in (tenants or {}).items()],
            exclude=[[rule, str(Path(path).resolve())] for rule, path in exclude])

        if dtype is None and device == "cpu":
            # SGLang's CPU forward is not row-invariant in bf16: a verify forward of D rows and a
            # decode forward of one row round differently, so near-ties flip and greedy output
            # depends on the drafts (SGLang's own NGRAM diverges from its plain output the same
            # way). In float32 both are identical to plain decoding on every prompt tested.
            dtype = "float32"
        kwargs: dict[str, Any] = {"model_path": str(self.model_path), "tp_size": tp_size, "dp_size": dp_size}
        for key, value in (("device", device), ("dtype", dtype), ("attention_backend", attention_backend),
                           ("mem_fraction_static", mem_fraction_static), ("max_total_tokens", max_total_tokens),
                           ("max_running_requests", max_running_requests), ("context_length", context_length)):
            if value is not None:
                kwargs[key] = value
        if self.algorithm is not None:
            kwargs["speculative_algorithm"] = self.algorithm
            kwargs["speculative_num_draft_tokens"] = draft_tokens
            if speculative in ("eagle3", "hybrid"):
                kwargs["speculative_draft_model_path"] = str(Path(eagle3).resolve())
            if speculative == "hybrid":
                # the head's chain fills the verify width (SGLang: topk 1 means num_steps + 1 rows);
                # overlap off: the hybrid's drafts read committed tokens from each request
                kwargs.update(speculative_num_steps=draft_tokens - 1, speculative_eagle_topk=1,
                              disable_overlap_schedule=True)
        kwargs.update(engine_kwargs or {})
        self.engine_kwargs = kwargs
        self.device = str(kwargs.get("device") or "auto")

        if engine is None:
            if not sglang_available():
                raise ConfigError("the SGLang backend needs SGLang: pip install -e '.[sglang]' in a clone of agentspec (docs/sglang.md)")
            if speculative in _POLICY:
                _check_plugin(speculative)
            os.environ[ENV] = self.scheduler_config.to_env()   # inherited by SGLang's spawned processes
            engine = _start_engine(kwargs, quiet=quiet)
        self.engine = engine

        sa = getattr(engine, "server_args", None)
        self._incremental = bool(getattr(sa, "incremental_streaming_output", False))
        running = getattr(sa, "max_running_requests", None) or max_running_requests
        self.max_running = int(running) if isinstance(running, int) and running > 0 else None
        tm = getattr(engine, "tokenizer_manager", None)
        ctx = getattr(tm, "context_len", None)
        if not isinstance(ctx, int) or ctx <= 0:
            ctx = context_length or model_cfg.get("max_position_embeddings") or 2048
        mril = getattr(tm, "max_req_input_len", None)
        # SGLang refuses prompts of max_req_input_len tokens or more and quietly caps
        # max_new_tokens at max_req_len - prompt - 1 (max_req_len = max_req_input_len + 5): the
        # window reported here is the one in which neither happens
        self._max_prompt = int(mril) - 1 if isinstance(mril, int) and mril > 0 else int(ctx)
        self._max_context = min(int(ctx), self._max_prompt + 5)

        self._lock = threading.Lock()
        self._active: dict[str, _Req] = {}
        self._raw_spec: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self._counts = {"submitted": 0, "finished": 0, "cancelled": 0, "failed": 0}
        self._closed = False
        self._close_once = threading.Lock()
        self._stopped = threading.Event()
        self._foreground = False
        self._loop = asyncio.new_event_loop()
        self._loop_ready = threading.Event()
        self._thread = threading.Thread(target=self._run_loop, name="agentspec-sglang", daemon=True)
        self._thread.start()
        self._loop_ready.wait(10)

    # ---- what the server asks -------------------------------------------------------------------

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def index(self) -> Any:
        return None   # the draft index lives in SGLang's scheduler processes

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        items = check_messages(messages)
        try:
            return self._tokenizer.encode(self._tokenizer.apply_chat_template(
                items, tools=list(tools) if tools else None, **dict(template_kwargs or {})))
        except ValueError as e:  # the chat template's raise_exception
            raise InvalidRequestError(str(e), param="messages") from None

    def encode_text(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError(f"text must be a string, got {type(text).__name__}", param="prompt")
        return self._tokenizer.encode(text)

    def spec_meta(self, request_id: str) -> dict | None:
        """SGLang's raw speculative fields (``spec_*`` of ``meta_info``) of a recent request."""
        return self._raw_spec.get(request_id)

    # ---- requests -----------------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, *, on_tokens: OnTokens, on_done: OnDone,
               should_stop: Callable[[], bool] | None = None) -> str:
        """Queue ``request``; its id. Raises InvalidRequestError / ContextLengthError (bad input,
        ``param`` naming it), QueueFullError, or BackendClosedError."""
        # names SGLang cannot run were refused at start-up (check_route_drafters)
        request = check_request(request, vocab_size=self._vocab_size, max_context=self._max_context,
                                max_prompt=self._max_prompt)
        ids, prediction, spec = request.prompt_ids, request.prediction_ids, request.spec
        temperature, top_p, top_k, stops = request.temperature, request.top_p, request.top_k, request.stop

        sampling: dict[str, Any] = {"max_new_tokens": request.max_tokens, "temperature": temperature, "top_p": top_p,
                                    "top_k": top_k if top_k > 0 else -1}
        if stops:
            sampling["stop"] = list(stops)
        if self._eos:
            sampling["stop_token_ids"] = list(self._eos)
        if request.seed is not None:
            sampling["sampling_seed"] = int(request.seed) % (2**63)   # used by SGLang's deterministic sampling
        if self.speculative in _POLICY:
            from agentspec.integrations.sglang.config import request_params

            sampling["custom_params"] = request_params(
                tenant=request.tenant, spec=spec is not None, greedy=request.greedy,
                budget=spec.budget if spec is not None else None, prediction=prediction,
                # the hybrid: the route's own list as it names it; a route naming none leaves the
                # worker's default (both drafters, merged as siblings)
                drafters=request.drafters if self.speculative == "hybrid" else None)
        # NGRAM and EAGLE3 cannot be turned off per request: they draft for every one
        spec_on = self.algorithm is not None and (spec is not None or self.speculative not in _POLICY)
        rid = request.request_id or f"sglang-{next(_ids)}-{secrets.token_hex(6)}"
        r = _Req(rid, request, ids, sampling, on_tokens, on_done, should_stop, spec_on)
        with self._lock:
            if self._closed:
                raise BackendClosedError("the backend is closed")
            if rid in self._active:
                raise InvalidRequestError(f"request_id {rid!r} is already running", param="request_id")
            limit = self.max_queue + (self.max_running or 0)
            if len(self._active) >= limit:
                raise QueueFullError(f"{len(self._active)} requests in flight (limit {limit}); retry later")
            self._active[rid] = r
            self._counts["submitted"] += 1
        try:
            self._loop.call_soon_threadsafe(self._start, r)
        except RuntimeError:   # the loop is closed: the backend closed meanwhile
            self._active.pop(rid, None)
            raise BackendClosedError("the backend is closed") from None
        return rid

    def stream(self, request: GenerationRequest) -> Iterator[list[int]]:
        """Yields each step's committed tokens; returns the ``Generation``."""
        return stream_via_submit(self, request)

    def cancel(self, request_id: str) -> bool:
        r = self._active.get(request_id)
        if r is None or r.done:
            return False
        r.cancel_requested = True
        try:
            self._loop.call_soon_threadsafe(self._cancel_task, r)
        except RuntimeError:
            pass
        return True

    # ---- the event loop -------------------------------------------------------------------------------

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._loop_ready.set)
        self._poller = self._loop.create_task(self._poll())
        try:
            self._loop.run_forever()
        finally:
            try:
                pending = [t for t in asyncio.all_tasks(self._loop) if not t.done()]
                for t in pending:
                    t.cancel()
                if pending:
                    self._loop.run_until_complete(asyncio.wait(pending, timeout=5))
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
            self._loop.close()

    async def _poll(self) -> None:
        """``should_stop`` of every request in flight, every 20 ms (client gone, timeout)."""
        while True:
            await asyncio.sleep(0.02 if self._active else 0.1)
            for r in list(self._active.values()):
                if r.done or r.task is None or r.cancel_requested:
                    continue
                try:
                    stop = r.should_stop is not None and bool(r.should_stop())
                except Exception:  # noqa: BLE001 - a failing predicate stops its request
                    stop = True
                if stop:
                    r.cancel_requested = True
                    r.task.cancel()

    def _start(self, r: _Req) -> None:
        if self._closed:
            self._finish(r, None, BackendClosedError("the backend closed before the request ran"))
            return
        if r.cancel_requested:
            self._finish(r, self._result(r, None, cancelled=True), None)
            return
        r.task = self._loop.create_task(self._drive(r))
        r.task.add_done_callback(lambda _t, r=r: self._task_done(r))

    def _task_done(self, r: _Req) -> None:
        """A task cancelled before it ran never enters ``_drive``'s handlers: end its request here."""
        if not r.done:
            if self._closed and not r.out:
                self._finish(r, None, BackendClosedError("the backend closed before the request ran"))
            else:
                self._finish(r, self._result(r, r.meta, cancelled=True), None)

    def _cancel_task(self, r: _Req) -> None:
        if r.task is not None and not r.task.done():
            r.task.cancel()

    async def _drive(self, r: _Req) -> None:
        stream = None
        try:
            from agentspec.integrations.sglang.config import cache_salt

            # cache_salt: SGLang keys its prefix cache by it, so tenants never share cached prefixes
            stream = await self.engine.async_generate(input_ids=list(r.ids), sampling_params=dict(r.sampling),
                                                      stream=True, rid=r.rid, cache_salt=cache_salt(r.request.tenant))
            finish: Any = None
            async for chunk in stream:
                meta = chunk.get("meta_info") or {}
                ids = chunk.get("output_ids")
                ids = list(ids) if ids is not None else []   # intermediate chunks share SGLang's growing list
                if self._incremental:
                    new = ids
                else:
                    new = ids[r.seen:]
                    r.seen = max(r.seen, len(ids))
                finish = meta.get("finish_reason")
                if finish is not None:
                    r.meta = dict(meta)
                    new = self._trim_stop_token(r, new, finish)
                if new:
                    if r.t_first is None:
                        r.t_first = time.perf_counter()
                    r.out.extend(new)
                    r.on_tokens(list(new))
                if finish is not None:
                    break
            kind = finish.get("type") if isinstance(finish, Mapping) else finish
            if kind == "abort":
                if r.cancel_requested:
                    self._finish(r, self._result(r, r.meta, cancelled=True), None)
                    return
                msg = finish.get("message") or "SGLang aborted the request"
                status = finish.get("status_code")
                err: Exception = (InvalidRequestError(str(msg)) if status == 400
                                  else RuntimeError(f"SGLang aborted the request: {msg}"))
                self._finish(r, None, err)
                return
            self._finish(r, self._result(r, r.meta), None)
        except asyncio.CancelledError:
            if self._closed and not r.out:
                self._finish(r, None, BackendClosedError("the backend closed before the request ran"))
            else:
                self._finish(r, self._result(r, r.meta, cancelled=True), None)
        except ValueError as e:   # SGLang's request validation (lengths, sampling values)
            self._finish(r, None, InvalidRequestError(str(e)))
        except Exception as e:  # noqa: BLE001 - reported to the caller
            self._finish(r, None, e)
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                try:   # a finished stream left at its last yield: let SGLang's generator end now
                    await aclose()
                except BaseException:  # noqa: BLE001 - nothing left to report
                    pass

    def _trim_stop_token(self, r: _Req, new: list[int], finish: Any) -> list[int]:
        """Drop the token a stop-on-token (EOS) left at the end of the output."""
        if not isinstance(finish, Mapping) or finish.get("type") != "stop":
            return new
        matched = finish.get("matched")
        if isinstance(matched, bool) or not isinstance(matched, (int, list)):
            return new   # a stop string (or a regex): its tokens stay, the text is cut
        tokens = set(matched) if isinstance(matched, list) else {matched}
        if new and (new[-1] in tokens or new[-1] in self._tokenizer.eos_token_ids):
            return new[:-1]
        if not new and r.out and (r.out[-1] in tokens or r.out[-1] in self._tokenizer.eos_token_ids):
            r.out.pop()   # already passed on (cannot happen with SGLang's streaming, kept for safety)
        return new

    def _finish(self, r: _Req, generation: Generation | None, error: BaseException | None) -> None:
        if r.done:
            return
        r.done = True
        self._active.pop(r.rid, None)
        if error is not None:
            self._counts["failed"] += 1
        elif generation is not None and generation.finish_reason == "cancelled":
            self._counts["cancelled"] += 1
        else:
            self._counts["finished"] += 1
        try:
            r.on_done(generation, error)
        except Exception as e:  # noqa: BLE001 - a failing callback must not kill the loop
            print(f"[agentspec] on_done failed for {r.rid}: {e!r}", file=sys.stderr, flush=True)

    def _result(self, r: _Req, meta: Mapping | None, *, cancelled: bool = False) -> Generation:
        meta = meta or {}
        now = time.perf_counter()
        out = list(r.out)
        text = self._tokenizer.decode(out)
        cut = stop_index(text, r.request.stop) if r.request.stop else -1
        if cut >= 0:
            text = text[:cut]
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, Mapping) else finish
        reason = "cancelled" if cancelled else ("length" if kind == "length" else "stop")
        stats = GenerationStats(prompt_tokens=len(r.ids), completion_tokens=len(out), spec_enabled=r.spec_on,
                                seed=r.request.seed)
        stats.spec_reason = (f"sglang {self.algorithm}" if r.spec_on else
                             "request: speculation off" if self.algorithm is not None else "sglang: no speculation")
        stats.seconds = now - r.t0
        stats.prefill_seconds = (r.t_first - r.t0) if r.t_first is not None else stats.seconds
        stats.decode_seconds = max(stats.seconds - stats.prefill_seconds, 0.0)
        raw = {k: v for k, v in meta.items() if isinstance(k, str) and k.startswith("spec_")}
        verify = _int(raw.get("spec_verify_ct"))
        if verify and not r.spec_on:   # AGENTSPEC with speculation off: root-only drafts, no draft tokens
            stats.steps = verify
            stats.mean_acceptance_length = len(out) / verify
        elif verify:
            stats.steps = verify
            stats.accepted_tokens = _int(raw.get("spec_num_correct_drafts"))
            stats.draft_tokens = _int(raw.get("spec_num_proposed_drafts"))
            hist = raw.get("spec_correct_drafts_histogram")
            if isinstance(hist, list) and sum(_int(c) for c in hist) == verify:
                stats.acceptance_lengths = [k + 1 for k, c in enumerate(hist) for _ in range(_int(c))]
            mat = raw.get("spec_accept_length")
            stats.mean_acceptance_length = (float(mat) if isinstance(mat, (int, float)) and not isinstance(mat, bool)
                                            else len(out) / verify)
            if r.spec_on:
                stats.draft_sources = {f"sglang:{self.algorithm}": verify}
            self._read_sources(stats, meta)
        else:
            stats.steps = max(len(out) - 1, 0) if out else 0   # decode forwards after the prefill
            stats.mean_acceptance_length = 1.0 if stats.steps else 0.0
        if raw:
            self._raw_spec[r.rid] = raw
            while len(self._raw_spec) > _RAW_SPEC_KEEP:
                self._raw_spec.popitem(last=False)
        return Generation(text=text, token_ids=out, finish_reason=reason, stats=stats)

    @staticmethod
    def _read_sources(stats: GenerationStats, meta: Mapping) -> None:
        """Per-source counts from the AGENTSPEC / AGENTSPEC_EAGLE3 workers' per-step records
        (``meta_info[SOURCE_KEY]``): ``source_steps`` / ``source_drafted`` / ``source_accepted`` as
        the embedded engine counts them, ``draft_sources`` by each step's sources ("suffix",
        "eagle3", "suffix+eagle3" for a merged tree) and ``draft_tokens`` the tokens really
        drafted (SGLang's ``spec_num_proposed_drafts`` counts the padded verify width)."""
        from agentspec.integrations.sglang.config import SOURCE_KEY, read_source_records

        values = meta.get(SOURCE_KEY)
        if not isinstance(values, list):
            return
        by_source = read_source_records(values)
        if not by_source:
            if stats.spec_enabled:
                stats.draft_sources = {}
                stats.draft_tokens = 0
            return
        stats.source_steps = {k: v[0] for k, v in by_source.items()}
        stats.source_drafted = {k: v[1] for k, v in by_source.items()}
        stats.source_accepted = {k: v[2] for k, v in by_source.items()}
        stats.draft_tokens = sum(stats.source_drafted.values())
        steps: dict[str, int] = {}
        for v in values:
            if isinstance(v, str) and v:
                key = "+".join(sorted({part.rsplit(":", 2)[0] for part in v.split(",")}))
                steps[key] = steps.get(key, 0) + 1
        stats.draft_sources = steps

    # ---- state ----------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        n = len(self._active)
        running = n if self.max_running is None else min(n, self.max_running)
        return {"status": "closed" if self._closed else "ok", "running": running, "waiting": n - running}

    def memory(self) -> dict[str, int]:
        return {}   # the draft index and the KV caches live in SGLang's scheduler processes

    def stats(self) -> dict[str, Any]:
        h = self.health()
        return {
            "backend": "sglang", "model": self.model_name, "model_path": str(self.model_path),
            "max_context": self.max_context, "device": self.device, "tp_size": self.tp_size, "dp_size": self.dp_size,
            "speculative": self.speculative, "speculative_algorithm": self.algorithm,
            "speculative_num_draft_tokens": self.draft_tokens if self.algorithm else None,
            "sglang_version": _sglang_version(), "max_running_requests": self.max_running,
            "max_queue": self.max_queue, "running": h["running"], "waiting": h["waiting"],
            "requests": dict(self._counts),
            "scheduler": "foreground" if self._foreground else "background",
            "tenants": [t.name for t in self.scheduler_config.tenants],
        }

    # ---- run / close ------------------------------------------------------------------------------------

    def run(self, on_ready: Callable[[], None] | None = None) -> None:
        """Block the calling thread until ``close()``; ``on_ready()`` first (requests are taken
        from the start: SGLang's scheduler runs in its own processes)."""
        with self._lock:
            if self._closed:
                raise BackendClosedError("the backend is closed")
            if self._foreground:
                raise RuntimeError("run() is running already")
            self._foreground = True
        try:
            if on_ready is not None:
                on_ready()
            while not self._stopped.wait(0.5):
                pass
        finally:
            self._foreground = False

    def close(self, timeout: float = 30.0) -> None:
        """Stop: requests that have not started fail (BackendClosedError), running ones end
        "cancelled"; the engine shuts down (its processes end); ``run()`` returns. Idempotent.
        No lock that ``run()``'s thread may hold: ``serve`` calls this from a signal handler."""
        self._closed = True
        if not self._close_once.acquire(blocking=False):
            return
        try:
            if self._thread.is_alive() and threading.current_thread() is not self._thread:
                try:
                    fut = asyncio.run_coroutine_threadsafe(self._cancel_all(), self._loop)
                    fut.result(timeout=min(timeout, 10.0))
                except Exception:  # noqa: BLE001 - the loop may be gone already
                    pass
                try:
                    self._loop.call_soon_threadsafe(self._loop.stop)
                except RuntimeError:
                    pass
                self._thread.join(timeout)
            for r in list(self._active.values()):   # anything the loop did not end
                self._finish(r, None, BackendClosedError("the backend is closed"))
            shutdown = getattr(self.engine, "shutdown", None)
            if callable(shutdown):
                try:
                    shutdown()
                except Exception as e:  # noqa: BLE001 - closing goes on
                    print(f"[agentspec] SGLang engine shutdown failed: {e!r}", file=sys.stderr, flush=True)
        finally:
            self._stopped.set()

    async def _cancel_all(self) -> None:
        tasks = []
        for r in list(self._active.values()):
            r.cancel_requested = True
            if r.task is not None and not r.task.done():
                r.task.cancel()
                tasks.append(r.task)
        if tasks:
            await asyncio.wait(tasks, timeout=5)

    def __enter__(self) -> "SGLangBackend":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---- helpers ------------------------------------------------------------------------------------------

def _start_engine(kwargs: dict[str, Any], *, quiet: bool) -> Any:
    """``sglang.Engine(**kwargs)``; ConfigError for arguments SGLang refuses, ModelLoadError else."""
    if str(kwargs.get("device") or "").startswith("cpu"):
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")   # SGLang's CPU path, read when it is imported
    try:
        import sglang
    except ImportError as e:
        raise ConfigError(f"the SGLang backend needs SGLang ({e}): pip install -e '.[sglang]' in a clone of agentspec (docs/sglang.md)") from e
    if not quiet:
        shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k != "model_path")
        print(f"[agentspec] starting SGLang {_sglang_version()} engine for {kwargs['model_path']} ({shown})",
              file=sys.stderr, flush=True)
    try:
        return sglang.Engine(**kwargs)
    except TypeError as e:   # an unknown keyword argument
        raise ConfigError(f"sglang.Engine refused its arguments: {e}") from e
    except (ValueError, AssertionError) as e:
        raise ConfigError(f"sglang.Engine refused its arguments: {type(e).__name__}: {e}") from e
    except Exception as e:  # noqa: BLE001 - a failed start (weights, memory, a child process)
        raise ModelLoadError(f"the SGLang engine failed to start: {type(e).__name__}: {e}") from e


def _check_plugin(speculative: str = "agentspec") -> None:
    """The AGENTSPEC / AGENTSPEC_EAGLE3 algorithms are registered by the ``sglang.srt.plugins`` entry point of this
    package, which SGLang loads in each of its processes: without it the engine cannot start."""
    import importlib.metadata
    import importlib.util

    try:
        found = importlib.util.find_spec("agentspec.integrations.sglang.plugin") is not None
    except (ImportError, ValueError):
        found = False
    eps = [ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")
           if ep.value.startswith("agentspec.")]
    if not found or not eps:
        what = "the module agentspec.integrations.sglang.plugin" if not found else \
            "the 'sglang.srt.plugins' entry point of agentspec-serve (install the package: pip install -e .)"
        raise ConfigError(f"--speculative {speculative} needs the agentspec SGLang plugin, but {what} is missing; "
                          "use --speculative ngram, eagle3 or none meanwhile")


def _int(v: Any) -> int:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


def _sglang_version() -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None
