"""``EmbeddedBackend``: the embedded torch engine behind the ``agentspec.backends.protocol.Backend`` protocol.

It owns what the server used to reach into the engine for: the continuous-batching scheduler
(``BatchEngine``) and its queue limit, the drafters each route names (built once per drafter
list on the shared suffix index, passed per request: the engine's own ``drafter`` is left as it
is; a server's routes are built at construction, so a draft head that is missing or does not
fit the model stops the start, not the first request), a request's prediction (a tenant-scoped
document in the index while the request runs), the tokenizer and chat template, the context
length and the model name.

The scheduler runs either on a thread of its own, started on the first ``submit`` (``background
=True``), or on the thread that calls ``run()`` (``agentspec serve`` runs it on the main thread:
on CPU, torch's OpenMP kernels are ~1.5x faster there, see ``BatchEngine``).
"""

from __future__ import annotations

import itertools
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from ..protocol import (
    GenerationRequest,
    OnDone,
    OnTokens,
    check_drafter_names,
    check_messages,
    check_request,
    model_name_for,
    stream_via_submit,
)
from ...errors import AgentSpecError, BackendClosedError, ConfigError, InvalidRequestError, QueueFullError

__all__ = ["EmbeddedBackend", "prediction_doc_id"]

_ids = itertools.count()


def prediction_doc_id(request_id: str) -> str:
    """The id of a request's prediction document in the draft index (there while it runs)."""
    return f"prediction\x1f{request_id}"


class EmbeddedBackend:
    """An ``EmbeddedEngine`` as a ``Backend``.

    ``index``: the shared ``SuffixIndex`` (workspaces, tenant histories, predictions); default a
    new one. ``model_name``: the id to report (default: from the engine's model path).
    ``max_queue``: requests waiting beyond this many raise QueueFullError. ``max_batch`` and
    ``budget_policy``: ``BatchEngine``'s ``max_batch`` and ``budget``. ``background``: run the
    scheduler on its own thread once a request comes (False: only ``run()`` runs it).
    ``drafters``: drafter lists to build now, by what names them (a server passes ``{"route
    'x'": ("suffix", "eagle3"), ...}``): one that cannot be built (a draft head missing, or not
    fitting the model) raises ``ConfigError`` naming it, its list and the problem."""

    def __init__(self, engine: Any, *, index: Any = None, model_name: str | None = None, max_queue: int = 256,
                 max_batch: int = 16, budget_policy: str = "load_aware", background: bool = True,
                 drafters: Mapping[str, Sequence[str]] | None = None) -> None:
        from .batch import BatchEngine

        if getattr(engine, "deterministic", False):
            raise ConfigError("the embedded backend batches requests, which the deterministic mode does not "
                              "support: load the engine without deterministic=True")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ConfigError(f"max_queue must be an integer >= 1, got {max_queue!r}")
        if index is None:   # the engine's: its drafters (``EmbeddedEngine.drafter_for``) draft from it
            index = getattr(getattr(engine, "drafter", None), "index", None)
        if index is None:
            from suffix_index import SuffixIndex

            index = SuffixIndex(vocab_size=engine.vocab_size)
        self.engine = engine
        self.model_name = model_name or model_name_for(getattr(engine, "model_path", None))
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.budget_policy = budget_policy
        self.background = background
        self._index = index
        self._drafters: dict[tuple[str, ...], Any] = {}
        for label, names in (drafters or {}).items():   # before the scheduler: nothing to close on failure
            self._prebuild(label, names)
        self._batch = BatchEngine(engine, max_batch=max_batch, budget_policy=budget_policy, background=False)
        self._lock = threading.Lock()
        self._active: dict[str, threading.Event] = {}   # request id -> its cancel flag
        self._thread: threading.Thread | None = None    # the background scheduler
        self._foreground = False                        # run() is running the scheduler
        self._closed = False

    # ---- what the server asks -------------------------------------------------------------------

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def index(self) -> Any:
        return self._index

    @property
    def batch(self) -> Any:
        """The ``BatchEngine`` (for tests and benchmarks; the server does not use it)."""
        return self._batch

    supports_grammar = True   # GenerationRequest.grammar: constrained decoding, exact with speculation

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        items = check_messages(messages)
        try:
            if tools or template_kwargs:
                tok = self.engine.tokenizer
                return tok.encode(tok.apply_chat_template(items, tools=list(tools) if tools else None,
                                                          **dict(template_kwargs or {})))
            return self.engine.encode(items)
        except ValueError as e:  # InvalidRequestError, or the chat template's raise_exception
            raise InvalidRequestError(str(e), param="messages") from None

    def encode_text(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError(f"text must be a string, got {type(text).__name__}", param="prompt")
        return self.engine.tokenizer.encode(text)

    def drafter_for(self, names: Sequence[str] | str) -> Any:
        """The drafter a drafter list names, built once per list on the shared index (the
        engine's ``drafter_for``, one cache). Unknown names raise InvalidRequestError (param
        "drafters")."""
        return self.engine.drafter_for(check_drafter_names(names), index=self._index)

    def _prebuild(self, label: str, names: Sequence[str]) -> None:
        """Build ``names`` now (``drafters=`` at construction); ConfigError naming ``label``."""
        try:
            self.drafter_for(names)
        except (AgentSpecError, ValueError, OSError) as e:   # a bug elsewhere keeps its traceback
            shown = [names] if isinstance(names, str) else list(names)
            raise ConfigError(f"{label}: drafters {shown}: {e}") from e

    # ---- requests -----------------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, *, on_tokens: OnTokens, on_done: OnDone,
               should_stop: Callable[[], bool] | None = None) -> str:
        """Queue ``request``; its id. Raises InvalidRequestError / ContextLengthError (bad input,
        ``param`` naming it: a grammar llguidance refuses is compiled here, before it is queued,
        and named "grammar") or QueueFullError (``max_queue`` requests already wait)."""
        request = check_request(request, vocab_size=self.vocab_size, max_context=self.max_context)
        constraint = None if request.grammar is None else self.engine.constraint_for(request.grammar)
        # the request's own spec.drafters, when set, over its route's list; a request that does
        # not speculate builds nothing (its route's draft head is not loaded for it)
        drafter = self.drafter_for(request.drafters or self.engine.default_drafters) if request.spec is not None \
            else None
        prediction = request.prediction_ids
        rid = request.request_id or f"embedded-{next(_ids)}-{secrets.token_hex(6)}"
        doc = prediction_doc_id(rid) if prediction else None
        cancelled = threading.Event()

        def stop() -> bool:
            return cancelled.is_set() or (should_stop is not None and bool(should_stop()))

        def done(generation: Any, error: Any) -> None:
            self._release(rid, doc)
            on_done(generation, error)

        with self._lock:
            if self._closed:
                raise BackendClosedError("the backend is closed")
            if rid in self._active:
                raise InvalidRequestError(f"request_id {rid!r} is already running", param="request_id")
            if self._batch.num_waiting >= self.max_queue:
                # full: a tenant holding less than its share of the queue (max_queue over the tenants
                # waiting, itself included) still gets in, so one tenant's flood cannot shut others out
                own, tenants = self._batch.waiting_share(request.tenant)
                share = -(-self.max_queue // (tenants + (own == 0)))
                if own >= share or self._batch.num_waiting >= 2 * self.max_queue:
                    raise QueueFullError(f"{self.max_queue} requests already waiting; retry later")
            if doc is not None:
                self._index.add_document(doc, prediction, tenant=request.tenant)
            self._active[rid] = cancelled
            try:
                self._batch.submit_request(request, drafter=drafter, on_tokens=on_tokens, on_done=done,
                                           should_stop=stop, constraint=constraint)
            except BaseException:
                self._release(rid, doc)
                raise
            if self.background and self._thread is None and not self._foreground:
                self._thread = threading.Thread(target=self._batch.serve_forever, name="agentspec-batch",
                                                daemon=True)
                self._thread.start()
        return rid

    def stream(self, request: GenerationRequest) -> Iterator[list[int]]:
        """Yields each step's committed tokens; returns the ``Generation``. Needs the scheduler
        running: ``background=True`` (the default) or ``run()`` on another thread."""
        if not self.background and not self._foreground:
            raise RuntimeError("stream() needs a running scheduler: this backend has background=False and run() "
                               "is not running (it would wait forever)")
        return stream_via_submit(self, request)

    def cancel(self, request_id: str) -> bool:
        flag = self._active.get(request_id)
        if flag is None:
            return False
        flag.set()
        return True

    def _release(self, rid: str, doc: str | None) -> None:
        self._active.pop(rid, None)
        if doc is not None:
            try:
                self._index.remove_document(doc)
            except Exception:  # noqa: BLE001 - bookkeeping must not fail the request's end
                pass

    # ---- state ----------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return {"status": "closed" if self._closed else "ok", "running": self._batch.num_running,
                "waiting": self._batch.num_waiting}

    def memory(self) -> dict[str, int]:
        out = {"index_bytes": self._index.nbytes}
        pc = getattr(self.engine, "prefix_cache", None)
        if pc is not None:
            out["prefix_cache_bytes"] = pc.bytes
        return out

    def stats(self) -> dict[str, Any]:
        e = self.engine
        out: dict[str, Any] = {
            "backend": "embedded", "model": self.model_name, "max_context": self.max_context,
            "device": str(getattr(e, "device", "")), "max_batch": self.max_batch, "max_queue": self.max_queue,
            "budget_policy": self.budget_policy,
            "step_costs_source": getattr(self._batch, "step_costs_source", None),
            "running": self._batch.num_running, "waiting": self._batch.num_waiting,
            "scheduler": "foreground" if self._foreground else "background" if self._thread is not None else "idle",
        }
        pc = getattr(e, "prefix_cache", None)
        if pc is not None:
            out["prefix_cache"] = {**pc.stats.to_dict(), "bytes": pc.bytes, "capacity_bytes": pc.capacity_bytes,
                                   "chunks": len(pc), "chunk_tokens": pc.chunk_tokens, "shared": pc.shared}
        for key, name in (("hardware", "hardware_summary"), ("kernels", "kernel_info")):
            fn = getattr(e, name, None)
            if callable(fn):
                try:
                    out[key] = fn()
                except Exception:  # noqa: BLE001 - stats are informational
                    pass
        return out

    # ---- the scheduler ---------------------------------------------------------------------------------

    def run(self, on_ready: Callable[[], None] | None = None) -> None:
        """Run the scheduler on this thread until ``close()``; ``on_ready()`` first, once requests
        are taken here (start the HTTP server from it, so none comes before)."""
        with self._lock:
            if self._closed:
                raise BackendClosedError("the backend is closed")
            if self._thread is not None:
                raise RuntimeError("the scheduler runs in the background already (a request came before run())")
            if self._foreground:
                raise RuntimeError("run() is running already")
            self._foreground = True
        try:
            if on_ready is not None:
                on_ready()
            self._batch.serve_forever()
        finally:
            self._foreground = False

    def close(self, timeout: float = 30.0) -> None:
        # no lock: a signal handler on the thread inside run() calls this (``serve``)
        self._closed = True
        self._batch.close(timeout)
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    def __enter__(self) -> "EmbeddedBackend":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
