"""``agentspec serve``: the OpenAI-compatible server on the embedded engine.

``build_state`` loads the engine, indexes each tenant's workspace into one shared suffix index
(tenants are isolated inside it) and opens the acceptance logs and metrics; ``create_app`` turns
that into a Starlette app; ``serve`` runs it under uvicorn.
"""

from __future__ import annotations

import ipaddress
import sys
from pathlib import Path
from typing import Any

from ..config import ServerConfig, load_server_config
from ..errors import ConfigError
from .app import ServerState, Tenant, create_app

__all__ = ["ServerState", "build_state", "create_app", "serve"]


def _drafter(names: tuple[str, ...], index: Any):
    from ..drafting import LookaheadDrafter, MergedDrafter, PromptLookupDrafter, SuffixDrafter

    make = {"suffix": lambda: SuffixDrafter(index), "lookahead": LookaheadDrafter, "prompt_lookup": PromptLookupDrafter}
    parts = [make[n]() for n in names]
    return parts[0] if len(parts) == 1 else MergedDrafter(*parts)


def model_id_for(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    p = Path(model)
    return p.name.removesuffix(".gguf") if p.suffix == ".gguf" else p.name


def build_state(config: ServerConfig | str | Path | None = None, *, repo: str | Path | None = None,
                engine: Any = None, engine_options: dict | None = None, watch: bool = True,
                quiet: bool = False) -> ServerState:
    """Everything the server needs. ``repo``: the default workspace (tenants without their own)."""
    from suffix_index import SuffixIndex

    from ..drafting import SuffixDrafter
    from ..engine import Engine
    from ..routing import Router
    from ..telemetry import Metrics, TenantLogSink
    from ..workspace import Workspace

    if not isinstance(config, ServerConfig):
        config = load_server_config(config)
    opts = dict(engine_options or {})
    if repo is not None and not Path(repo).is_dir():
        raise ConfigError(f"--repo is not a directory: {str(repo)!r}")
    for t in config.tenants:
        if t.workspace is not None and not Path(t.workspace).is_dir():
            raise ConfigError(f"tenant {t.name!r}: workspace is not a directory: {t.workspace!r}")
    if engine is None:
        engine = Engine.embedded(quiet=quiet, **opts)
    index = SuffixIndex(vocab_size=engine.vocab_size)
    engine.drafter = SuffixDrafter(index)
    tenants: dict[str, Tenant] = {}
    specs = config.tenants or []
    names = [(t.name, t.workspace) for t in specs] or [("default", None)]
    for name, ws_path in names:
        root = ws_path if ws_path is not None else repo
        ws = None
        if root is not None:
            if not quiet:
                print(f"[agentspec] indexing workspace {Path(root).resolve()} for tenant {name!r}",
                      file=sys.stderr, flush=True)
            ws = Workspace(root, tenant=name, index=index, tokenizer=engine.tokenizer, watch=watch,
                           progress=not quiet and sys.stderr.isatty())
            if not quiet:
                s = ws.summary()
                print(f"[agentspec]   {s['files']} files, {s['chunks']} chunks, {s['tokens']} tokens "
                      f"in {s['seconds']:.1f}s", file=sys.stderr, flush=True)
        tenants[name] = Tenant(name=name, workspace=ws, root=ws.root if ws is not None else None)
    drafters: dict[str, Any] = {"suffix": engine.drafter}
    for rule in config.routes:
        key = "+".join(rule.drafters or ("suffix",))
        if key not in drafters:
            drafters[key] = _drafter(tuple(rule.drafters), index)
    keys = {k: t.name for t in specs for k in t.api_keys}
    sink = TenantLogSink(config.server.log_dir, max_bytes=config.server.log_max_bytes,
                         backups=config.server.log_backups)
    metrics = Metrics(max_tenants=config.server.metrics_max_tenants)
    return ServerState(engine=engine, config=config, tenants=tenants, router=Router(config.routes),
                       drafters=drafters, index=index, sink=sink, metrics=metrics,
                       model_id=config.server.model_name or model_id_for(opts.get("model")),
                       require_key=bool(specs), keys=keys)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(state: ServerState, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning") -> None:
    """Run the server until SIGINT/SIGTERM. The batch scheduler runs on this (the main) thread and
    uvicorn's event loop on another: on CPU, torch's OpenMP kernels are ~1.5x faster when the
    process's main thread issues them (see ``BatchEngine``)."""
    import signal
    import threading

    import uvicorn

    from .worker import Worker

    cfg = state.config.server
    state.worker = Worker(state.engine, max_queue=cfg.max_queue, max_batch=cfg.max_batch, budget=cfg.budget_policy,
                          background=False)
    app = create_app(state)
    base = f"http://{host}:{port}"
    print(f"[agentspec] serving {state.model_id!r} on {base}  (tenants: {', '.join(state.tenants)}; "
          f"logs: {Path(state.config.server.log_dir).resolve()})", file=sys.stderr, flush=True)
    key = "$AGENTSPEC_API_KEY" if state.require_key else "none"
    print(f"""[agentspec] try:
  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' -H 'Authorization: Bearer {key}' \\
    -d '{{"model": "{state.model_id}", "temperature": 0, "messages": [{{"role": "user", "content": "Write hello world in Python."}}]}}'
  python -c "import openai; c = openai.OpenAI(base_url='{base}/v1', api_key='{key}'); print(c.chat.completions.create(model='{state.model_id}', temperature=0, messages=[{{'role': 'user', 'content': 'Hi'}}]).choices[0].message.content)"
  agentspec stats --log-dir {state.config.server.log_dir}""", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=5))

    def run_http():
        try:
            server.run()
        finally:  # uvicorn stopped (or failed to bind): stop the scheduler too
            state.worker.close()

    http = threading.Thread(target=run_http, name="agentspec-http", daemon=True)

    def stop(signum, frame):
        server.should_exit = True
        state.worker.close()

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    http.start()
    try:
        state.worker.batch.serve_forever()   # returns once the worker is closed
    finally:
        server.should_exit = True
        http.join(15)
        for s, h in previous.items():
            signal.signal(s, h)
        for t in state.tenants.values():
            if t.workspace is not None:
                t.workspace.close()
