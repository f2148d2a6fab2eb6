"""In-process mode: the server's request handling without HTTP.

``LocalTransport`` takes the body dicts a client would POST and returns the dicts (or, for a
stream, the events) a server would answer with, so the client parses both modes with one code
path and results have the same types and fields. Bodies are decoded with the server's own
structs (``agentspec.server.protocol``: the same validation, the same 400s), turned into a
``GenerationRequest`` by the server's own helpers (``agentspec.server.app``: routes, context
checks, usage and spec stats) and run on an ``EmbeddedBackend`` over an ``EmbeddedEngine``,
which is loaded on the first request. Errors are raised as the exceptions the HTTP transport
would raise for the same response.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import types
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from .errors import APITimeoutError, error_for_status

__all__ = ["AsyncLocalTransport", "LocalTransport"]

_json = msgspec.json.Encoder()
_END = object()


def _api_error(e: Any):
    return error_for_status(e.status, e.body())


def _model_id(engine: Any) -> str:
    """The id ``agentspec serve`` reports for this engine's model (the bundled one by its name)."""
    from ..engine.backend import model_name_for
    from ..engine.weights import bundled_model_path

    path = getattr(engine, "model_path", None)
    try:
        bundled = path is not None and Path(path).resolve() == bundled_model_path().resolve()
    except Exception:  # noqa: BLE001 - the bundled model is not installed
        bundled = False
    return model_name_for(None if bundled else path)


class LocalTransport:
    """The embedded engine behind the server's JSON API, in this process.

    ``engine``: an ``EmbeddedEngine`` already loaded (else one is loaded on first use with
    ``engine_options``, e.g. ``{"model": "x.gguf"}``). ``repo``: a workspace folder, indexed as
    the server indexes ``--repo`` (drafts come from its files; ``apply(path=...)`` resolves in
    it; ``watch``: follow edits on disk). ``config``: a ``ServerConfig`` (or TOML path) for routes
    and defaults."""

    def __init__(self, *, engine: Any = None, engine_options: dict | None = None, repo: str | Path | None = None,
                 config: Any = None, max_batch: int = 8, tenant: str = "default", watch: bool = False) -> None:
        self._engine = engine
        self._engine_options = dict(engine_options or {})
        self._repo = repo
        self._config = config
        self._max_batch = max_batch
        self._tenant_name = tenant
        self._watch = watch
        self._lock = threading.Lock()
        self._state: Any = None
        self._workspace: Any = None
        self._closed = False

    # ---- lifecycle ----------------------------------------------------------------------------

    def _ready(self) -> Any:
        with self._lock:
            if self._closed:
                raise error_for_status(503, {"error": {"message": "the client is closed", "type": "server_error",
                                                       "code": "shutting_down"}})
            if self._state is None:
                self._state = self._load()
            return self._state

    def _load(self) -> Any:
        from ..config import ServerConfig, load_server_config
        from ..engine import Engine
        from ..engine.backend import EmbeddedBackend
        from ..routing import Router
        from ..server.app import Tenant

        config = self._config if isinstance(self._config, ServerConfig) else load_server_config(self._config)
        engine = self._engine if self._engine is not None else Engine.embedded(quiet=True, **self._engine_options)
        router = Router(config.routes)
        drafters = {f"route {r.name!r}": r.drafters for r in router.configured() if r.spec is not None}
        backend = EmbeddedBackend(engine, max_batch=self._max_batch, max_queue=config.server.max_queue,
                                  model_name=config.server.model_name or _model_id(engine), drafters=drafters)
        root = None
        if self._repo is not None:
            from ..workspace import Workspace

            self._workspace = Workspace(self._repo, tenant=self._tenant_name, index=backend.index,
                                        tokenizer=backend.tokenizer, watch=self._watch, progress=False)
            root = self._workspace.root
        return types.SimpleNamespace(backend=backend, router=router, config=config, model_id=backend.model_name,
                                     tenant=Tenant(name=self._tenant_name, workspace=self._workspace, root=root))

    @property
    def workspace(self) -> Any:
        """The ``Workspace`` of ``repo`` (None without one); loads the engine if needed."""
        self._ready()
        return self._workspace

    def close(self) -> None:
        with self._lock:
            self._closed = True
            state, self._state = self._state, None
        if state is not None:
            state.backend.close()
        if self._workspace is not None:
            self._workspace.close()

    # ---- the API ------------------------------------------------------------------------------------

    def request(self, method: str, path: str, body: dict | None = None, *, timeout: float | None = None) -> dict:
        from ..server.protocol import APIError

        state = self._ready()
        try:
            if method == "GET":
                return self._get(state, path)
            handler = self._handler(path)
            gen_fn, respond, _, _ = handler(state, body or {}, stream=False)
            return respond(_drain(gen_fn(timeout)))
        except APIError as e:
            raise _api_error(e) from None

    def stream(self, path: str, body: dict, *, timeout: float | None = None) -> Iterator[dict]:
        """Submits now (bad input raises here); iterate for the events."""
        from ..server.protocol import APIError

        state = self._ready()
        try:
            gen_fn, _, chunk, final = self._handler(path)(state, body, stream=True)
            tokens = gen_fn(timeout)
        except APIError as e:
            raise _api_error(e) from None
        return _events(tokens, state.backend.tokenizer, gen_fn.call, chunk, final, getattr(gen_fn, "progress", None))

    def _handler(self, path: str) -> Callable:
        from ..server.protocol import APIError

        handlers = {"/v1/chat/completions": self._chat, "/v1/completions": self._completions,
                    "/v1/apply": self._apply}
        if path not in handlers:
            raise APIError(404, f"no route POST {path}", type="not_found_error", code="not_found")
        return handlers[path]

    def _get(self, state: Any, path: str) -> dict:
        from ..server.protocol import APIError

        card = {"id": state.model_id, "object": "model", "owned_by": "agentspec",
                "max_model_len": state.backend.max_context}
        if path == "/v1/models":
            return {"object": "list", "data": [card]}
        if path == "/health":
            return {**state.backend.health(), "model": state.model_id}
        raise APIError(404, f"no route GET {path}", type="not_found_error", code="not_found")

    # ---- endpoints: as agentspec.server.app's, minus HTTP ---------------------------------------------

    def _parse(self, state: Any, body: dict, body_type: Any) -> tuple[Any, str]:
        from ..server import app
        from ..server.protocol import decode_body

        req = decode_body(_json.encode(body), body_type)
        req.check_unsupported()
        return req, app._check_model(state, req.model)

    def _chat(self, state: Any, body: dict, *, stream: bool):
        from ..apply import chat_fast_apply
        from ..errors import InvalidRequestError
        from ..server import app
        from ..server.protocol import APIError, ChatCompletionRequest

        t0 = time.monotonic()
        req, model = self._parse(state, body, ChatCompletionRequest)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": app._text(m.content)}
                    for m in req.messages]
        prediction = app._text(req.prediction.content) if req.prediction is not None else None
        messages, apply_code = chat_fast_apply(messages)
        if apply_code is not None and prediction is None:
            prediction = apply_code
        try:
            ids = state.backend.encode_chat(messages)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param="messages", code="invalid_value") from None
        call = app._resolve(state, endpoint="chat.completions", tenant=state.tenant, model=model, ids=ids,
                            temperature=1.0 if req.temperature is None else req.temperature, top_p=req.top_p,
                            top_k=req.top_k, seed=req.seed, stop=req.stop,
                            max_tokens=req.max_completion_tokens or req.max_tokens, speculation=req.speculation,
                            prediction=prediction, session=req.prompt_cache_key or req.user, stream=stream,
                            include_usage=bool(req.stream_options and req.stream_options.include_usage),
                            want_stats=req.spec_stats, t0=t0, prefix="chatcmpl")
        base = {"id": call.request_id, "created": call.created, "model": model}

        def respond(gen) -> dict:
            out = {**base, "object": "chat.completion",
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": gen.text}, "logprobs": None,
                                "finish_reason": app._finish_reason(gen.finish_reason)}],
                   "usage": app.usage(call, gen.token_ids, gen.stats)}
            if call.want_stats:
                out["spec"] = app.spec_info(call, gen.stats)
            return out

        def chunk(delta: str) -> dict:
            return {**base, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": {"content": delta}, "logprobs": None, "finish_reason": None}]}

        def final(gen, tail: str) -> list[dict]:
            return app._final_chunks(call, gen, {**base, "object": "chat.completion.chunk"},
                                     {"index": 0, "delta": {"content": tail} if tail else {}, "logprobs": None,
                                      "finish_reason": app._finish_reason(gen.finish_reason)})

        return _generation(state, call), respond, chunk, final

    def _completions(self, state: Any, body: dict, *, stream: bool):
        from ..server import app
        from ..server.protocol import APIError, CompletionRequest

        t0 = time.monotonic()
        req, model = self._parse(state, body, CompletionRequest)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) != 1:
                raise APIError(400, f"one prompt per request is supported, got a batch of {len(prompt)}",
                               param="prompt", code="unsupported_parameter")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
            ids = state.backend.encode_text(prompt)
        elif not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise APIError(400, "prompt must be a string, a list of token ids, or a batch of one of either",
                           param="prompt", code="invalid_value")
        else:
            ids = list(prompt)
        call = app._resolve(state, endpoint="completions", tenant=state.tenant, model=model, ids=ids,
                            temperature=1.0 if req.temperature is None else req.temperature, top_p=req.top_p,
                            top_k=req.top_k, seed=req.seed, stop=req.stop, max_tokens=req.max_tokens,
                            speculation=req.speculation,
                            prediction=app._text(req.prediction.content) if req.prediction is not None else None,
                            session=req.prompt_cache_key or req.user, stream=stream,
                            include_usage=bool(req.stream_options and req.stream_options.include_usage),
                            want_stats=req.spec_stats, t0=t0, prefix="cmpl")
        base = {"id": call.request_id, "object": "text_completion", "created": call.created, "model": model}

        def respond(gen) -> dict:
            out = {**base, "choices": [{"index": 0, "text": gen.text, "logprobs": None,
                                        "finish_reason": app._finish_reason(gen.finish_reason)}],
                   "usage": app.usage(call, gen.token_ids, gen.stats)}
            if call.want_stats:
                out["spec"] = app.spec_info(call, gen.stats)
            return out

        def chunk(delta: str) -> dict:
            return {**base, "choices": [{"index": 0, "text": delta, "logprobs": None, "finish_reason": None}]}

        def final(gen, tail: str) -> list[dict]:
            return app._final_chunks(call, gen, base, {"index": 0, "text": tail, "logprobs": None,
                                                       "finish_reason": app._finish_reason(gen.finish_reason)})

        return _generation(state, call), respond, chunk, final

    def _apply(self, state: Any, body: dict, *, stream: bool):
        from ..apply import build_apply
        from ..errors import InvalidRequestError
        from ..server import app
        from ..server.protocol import APIError, ApplyRequest

        t0 = time.monotonic()
        req, model = self._parse(state, body, ApplyRequest)
        if (req.code is None) == (req.path is None):
            raise APIError(400, "give exactly one of `code` or `path`", param="code", code="invalid_value")
        if not req.update and not req.instruction:
            raise APIError(400, "give `update` (an edit snippet) and/or `instruction`", param="update",
                           code="invalid_value")
        code = req.code if req.code is not None else app._read_workspace_file(
            state.tenant, req.path, state.config.server.max_body_bytes)   # the server's checks, same errors
        name = Path(req.path).name if req.path is not None else "the file"
        try:
            plan = build_apply(code, req.update, req.instruction, name, tokenizer=state.backend.tokenizer)
            ids = state.backend.encode_chat(plan.messages)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.param if e.param != "messages" else "code",
                           code="invalid_value") from None
        max_tokens = req.max_tokens or plan.max_tokens(state.backend.max_context - len(ids))
        call = app._resolve(state, endpoint="apply", tenant=state.tenant, model=model, ids=ids,
                            temperature=req.temperature, top_p=None, top_k=None, seed=req.seed, stop=None,
                            max_tokens=max_tokens, speculation=req.speculation, prediction=plan.prediction_ids,
                            session=req.prompt_cache_key, stream=stream, include_usage=True, want_stats=True, t0=t0,
                            prefix="apply")
        base = {"id": call.request_id, "object": "apply", "created": call.created, "model": model}
        if req.path is not None:
            base["path"] = req.path

        def respond(gen) -> dict:
            return {**base, "merged_code": plan.finish(gen.text), "finish_reason": app._finish_reason(gen.finish_reason),
                    "usage": app.usage(call, gen.token_ids, gen.stats), "spec": app.spec_info(call, gen.stats)}

        progress = {"completion_tokens": 0, "steps": 0}

        def chunk(delta: str) -> dict:
            return {**base, "object": "apply.chunk", "delta": delta, **progress}

        def final(gen, tail: str) -> list[dict]:
            return [{**respond(gen), "object": "apply.chunk", "delta": tail}]

        gen_fn = _generation(state, call)
        gen_fn.progress = progress  # type: ignore[attr-defined]
        return gen_fn, respond, chunk, final


# ---- running one request ----------------------------------------------------------------------------------

def _generation(state: Any, call: Any) -> Callable:
    """A function of the timeout that submits ``call`` (bad input and a full queue raise then,
    as the server's ``_submit`` maps them) and returns the generator of its committed tokens,
    whose return value is the ``Generation``."""
    from ..backend import GenerationRequest
    from ..errors import BackendClosedError, ContextLengthError, InvalidRequestError, QueueFullError
    from ..server import app
    from ..server.protocol import APIError

    def start(timeout: float | None) -> Iterator[list[int]]:
        request = GenerationRequest(
            prompt_ids=call.ids, max_tokens=call.max_tokens, temperature=call.temperature, top_p=call.top_p,
            top_k=call.top_k, seed=call.seed, stop=call.stop, spec=call.route.spec, drafters=call.route.drafters,
            tenant=call.tenant.name, route=call.route.name, session=call.session, request_id=call.request_id,
            prediction_ids=call.prediction)
        deadline = None if timeout is None else time.monotonic() + timeout
        q: queue.SimpleQueue = queue.SimpleQueue()
        try:
            rid = state.backend.submit(request, on_tokens=q.put, on_done=lambda g, e: q.put((_END, g, e)),
                                       should_stop=(lambda: time.monotonic() > deadline) if deadline else None)
        except ContextLengthError as e:
            raise APIError(400, str(e), param=app._PARAMS.get(e.param, e.param),
                           code="context_length_exceeded") from None
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=app._PARAMS.get(e.param, e.param), code="invalid_value") from None
        except QueueFullError as e:
            raise APIError(503, f"server overloaded: {e}", type="server_error", code="overloaded") from None
        except BackendClosedError:
            raise APIError(503, "the client is closed", type="server_error", code="shutting_down") from None

        def tokens() -> Iterator[list[int]]:
            finished = False
            try:
                while True:
                    item = q.get()
                    if isinstance(item, tuple) and item and item[0] is _END:
                        finished = True
                        _, gen, err = item
                        if err is not None:
                            raise _api_error(app._engine_error(err))
                        if gen.finish_reason == "cancelled":
                            raise APITimeoutError(f"request timed out after {timeout} s", code="timeout")
                        return gen
                    yield item
            finally:
                if not finished:
                    state.backend.cancel(rid)

        return tokens()

    start.call = call  # type: ignore[attr-defined]
    return start


def _drain(tokens: Iterator[list[int]]) -> Any:
    while True:
        try:
            next(tokens)
        except StopIteration as done:
            return done.value


def _events(tokens: Iterator[list[int]], tokenizer: Any, call: Any, chunk: Callable, final: Callable,
            progress: dict | None = None) -> Iterator[dict]:
    """The events of a stream, as the server's SSE stream carries them (without ``[DONE]``)."""
    from ..text import TextStream

    text = TextStream(tokenizer, call.stop)
    try:
        while True:
            try:
                step = next(tokens)
            except StopIteration as done:
                yield from final(done.value, text.finish(done.value.text))
                return
            if progress is not None:
                progress["completion_tokens"] += len(step)
                progress["steps"] += 1
            delta = text.push(step)
            if delta:
                yield chunk(delta)
    finally:
        tokens.close()


class AsyncLocalTransport:
    """``LocalTransport`` for ``AsyncClient``: the engine's calls run in worker threads."""

    def __init__(self, **options: Any) -> None:
        self.local = LocalTransport(**options)

    async def request(self, method: str, path: str, body: dict | None = None, *, timeout: float | None = None) -> dict:
        return await asyncio.to_thread(self.local.request, method, path, body, timeout=timeout)

    async def stream(self, path: str, body: dict, *, timeout: float | None = None) -> AsyncIterator[dict]:
        """One thread per stream pumps the events into the loop; closing the stream (or cancelling
        the task iterating it) cancels the request at its next decode step."""
        events = await asyncio.to_thread(self.local.stream, path, body, timeout=timeout)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        closing = threading.Event()

        def put(item: tuple) -> None:
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:   # the loop is gone: nobody is listening any more
                closing.set()

        def pump() -> None:
            try:
                for event in events:
                    if closing.is_set():
                        return
                    put((True, event))
                put((False, None))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
                put((False, e))
            finally:
                events.close()   # here, in the thread that ran it: cancels the request if unfinished

        threading.Thread(target=pump, name="agentspec-sdk-stream", daemon=True).start()

        async def run() -> AsyncIterator[dict]:
            try:
                while True:
                    ok, value = await q.get()
                    if ok:
                        yield value
                    elif value is None:
                        return
                    else:
                        raise value
            finally:
                closing.set()

        return run()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.local.close)
