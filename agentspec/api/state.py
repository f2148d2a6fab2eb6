"""The server's state, built once: the backend, the tenants (workspaces, API keys), routes,
sessions, limits, the acceptance logs and metrics. The HTTP server and the in-process SDK build
it with the same ``build_state`` and hand it to ``agentspec.api.handling``.

``build_state`` loads the engine and wraps it in a backend (``agentspec.backends.protocol.Backend``:
``agentspec.backends.embedded.backend.EmbeddedBackend``, or ``agentspec.integrations.sglang.backend.SGLangBackend``
with ``backend="sglang"``: nothing else talks to the engine), indexes each tenant's workspace
into the backend's shared suffix index (tenants are isolated inside it) and opens the
acceptance logs and metrics.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..backends.protocol import Backend
from ..config import ServerConfig, load_server_config
from ..errors import ConfigError
from .routing import Router
from .limits import TenantLimits
from .sessions import SessionRegistry

__all__ = ["ServerState", "Tenant", "build_state", "model_id_for"]


@dataclass
class Tenant:
    name: str
    workspace: Any = None          # agentspec.Workspace or None
    root: Path | None = None


@dataclass
class ServerState:
    """Everything the handlers share. Built by ``agentspec.server.build_state``."""

    backend: Backend               # the engine, behind agentspec.backends.protocol.Backend (nothing else is used)
    config: ServerConfig
    tenants: dict[str, Tenant]
    router: Router
    sink: Any                      # telemetry.TenantLogSink
    metrics: Any                   # telemetry.Metrics
    model_id: str
    require_key: bool
    keys: dict[str, str] = field(default_factory=dict)   # api key -> tenant
    sessions: SessionRegistry = field(default_factory=SessionRegistry)   # session id -> owning tenant
    started: float = field(default_factory=time.time)
    limits: TenantLimits | None = None   # per-tenant max_concurrent / requests_per_minute (from config)
    draining: bool = False         # shutting down: new generation requests get 503 (``serve``'s SIGTERM)
    owned: tuple = ()              # OwnedPath: the server's own files (config, log_dir, caches), no tenant's
    # the Host names served (lower case; "[::1]" bracketed), or None for any: a server without API
    # keys bound to loopback answers only loopback names (``serve`` sets it), against DNS rebinding
    allowed_hosts: frozenset | None = None
    jobs: set = field(default_factory=set, repr=False)   # jobs submitted and not finished
    jobs_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def cancel_jobs(self) -> int:
        """Cancel every unfinished job because the server is shutting down (each stops at its
        next decode step; its client gets a 503 ``shutting_down`` error); how many."""
        with self.jobs_lock:
            jobs = list(self.jobs)
        for job in jobs:
            job.shutdown = True
            job.cancel()
        return len(jobs)

    @property
    def default_tenant(self) -> Tenant:
        """The one tenant of a server without API keys (no tenants configured)."""
        return next(iter(self.tenants.values()))

    def close(self) -> None:
        """Stop the backend, stop watching the workspaces, write out the acceptance logs."""
        try:
            self.backend.close()
        finally:
            for t in self.tenants.values():
                if t.workspace is not None:
                    t.workspace.close()
            self.sink.close()   # every acceptance record queued so far is written and fsynced

    def __post_init__(self) -> None:
        if self.limits is None:
            self.limits = TenantLimits({t.name: (t.max_concurrent, t.requests_per_minute)
                                        for t in (self.config.tenants or [])})



def model_id_for(model: str | None) -> str:
    from ..backends.protocol import model_name_for

    return model_name_for(model)


def _engine_model_id(engine: Any) -> str:
    """The id served for an embedded engine's model: the bundled one by its name, another by its
    file or folder name."""
    from ..backends.embedded.weights import bundled_model_path

    path = getattr(engine, "model_path", None)
    try:
        bundled = path is not None and Path(path).resolve() == bundled_model_path().resolve()
    except Exception:  # noqa: BLE001 - the bundled model is not installed
        bundled = False
    return model_id_for(None if bundled else path)


def server_owned_paths(config: ServerConfig, config_path: str | Path | None) -> tuple:
    """The server's own files and folders, which no tenant sees (``OwnedPath``, resolved now): its
    config file (it holds every tenant's keys), ``log_dir`` (every tenant's request records) and
    the cache folder (converted weights, step-cost profiles)."""
    from ..backends.embedded.weights import cache_root
    from ..workspace.ignore import OwnedPath

    owned = [OwnedPath.of("log_dir", config.server.log_dir), OwnedPath.of("cache folder", cache_root())]
    if config_path is not None:
        owned.insert(0, OwnedPath.of("config file", config_path))
    return tuple(owned)


def build_state(config: ServerConfig | str | Path | None = None, *, repo: str | Path | None = None,
                engine: Any = None, engine_options: dict | None = None, watch: bool = True,
                quiet: bool = False, backend: str = "embedded", sglang_options: dict | None = None,
                default_tenant: str = "default", max_batch: int | None = None,
                config_path: str | Path | None = None) -> ServerState:
    """Everything the server needs. ``repo``: the default workspace (tenants without their own).
    ``default_tenant``: the name of the one tenant when the config names none. ``max_batch``:
    instead of the config's (the in-process SDK's own default). ``config_path``: the file
    ``config`` was read from, when it is given already read (a path ``config`` is its own): with
    ``log_dir`` and the cache folder it is excluded from every workspace and refused by
    ``/v1/apply`` (``server_owned_paths``).

    ``backend="embedded"`` (default): ``engine`` is an already loaded ``EmbeddedEngine``
    (default: load one with ``engine_options``), wrapped here in an ``EmbeddedBackend``; each
    tenant's workspace is indexed into its shared suffix index in this process.

    ``backend="sglang"``: an in-process ``sglang.Engine`` behind ``SGLangBackend``, started
    with ``sglang_options`` (its keyword arguments: ``model`` (a Hugging Face folder, required),
    ``speculative``, ``draft_tokens``, ``eagle3``, ``tp_size``, ``dp_size``, ``device``,
    ``dtype``, ``engine_kwargs``, ...; ``engine``: an engine already started, for tests). The
    tenants' workspaces are indexed and watched inside SGLang's scheduler processes (the
    ``SchedulerConfig`` the backend puts in ``$AGENTSPEC_SGLANG``), so tenants here have no
    ``Workspace``, only their resolved ``root`` (``/v1/apply`` reads files from it). Routes may
    not name drafters the engine's one algorithm does not provide
    (``agentspec.integrations.sglang.backend.check_route_drafters``)."""
    if backend not in ("embedded", "sglang"):
        raise ConfigError(f"backend must be 'embedded' or 'sglang', got {backend!r}")
    if not isinstance(config, ServerConfig):
        if config is not None and config_path is None:
            config_path = config
        config = load_server_config(config)
    owned = server_owned_paths(config, config_path)
    if repo is not None and not Path(repo).is_dir():
        raise ConfigError(f"--repo is not a directory: {str(repo)!r}")
    for t in config.tenants:
        if t.workspace is not None and not Path(t.workspace).is_dir():
            raise ConfigError(f"tenant {t.name!r}: workspace is not a directory: {t.workspace!r}")
    if backend == "sglang":
        if engine_options:
            raise ConfigError("engine_options are the embedded engine's; pass sglang_options with backend='sglang'")
        return _build_sglang_state(config, repo=repo, engine=engine, options=sglang_options, watch=watch, quiet=quiet,
                                   default_tenant=default_tenant, owned=owned)
    if sglang_options:
        raise ConfigError("sglang_options need backend='sglang'")
    from ..backends import Engine
    from ..backends.embedded.backend import EmbeddedBackend
    from ..drafting.registry import DEFAULT_DRAFTERS
    from ..workspace import Workspace

    opts = dict(engine_options or {})
    if opts.get("deterministic"):
        raise ConfigError("the server batches requests, which the deterministic mode does not support")
    cfg = config.server
    if engine is None:   # (an engine passed in keeps the prefix cache its caller gave it)
        opts.setdefault("prefix_cache_bytes", cfg.prefix_cache_bytes)
        opts.setdefault("prefix_cache_shared", cfg.prefix_cache_shared)
        engine = Engine.embedded(quiet=quiet, **opts)
    router = Router(config.routes)
    # every speculating route's drafters, built now: a draft head ("eagle3") that is missing or
    # does not fit the model stops the start with a ConfigError naming the route and the problem,
    # instead of failing its first request; routes that do not name a head load none
    default = getattr(engine, "default_drafters", DEFAULT_DRAFTERS)
    route_drafters = {f"route {r.name!r}": r.drafters or default for r in router.configured() if r.spec is not None}
    backend = EmbeddedBackend(engine, model_name=cfg.model_name or _engine_model_id(engine),
                              max_queue=cfg.max_queue, max_batch=max_batch or cfg.max_batch,
                              budget_policy=cfg.budget_policy,
                              drafters=route_drafters)
    tenants: dict[str, Tenant] = {}
    for name, root in _tenant_roots(config, repo, default_tenant):
        ws = None
        if root is not None:
            if not quiet:
                print(f"[agentspec] indexing workspace {root} for tenant {name!r}", file=sys.stderr, flush=True)
            ws = Workspace(root, tenant=name, index=backend.index, tokenizer=backend.tokenizer, watch=watch,
                           exclude=owned, progress=not quiet and sys.stderr.isatty())
            if not quiet:
                s = ws.summary()
                print(f"[agentspec]   {s['files']} files, {s['chunks']} chunks, {s['tokens']} tokens "
                      f"in {s['seconds']:.1f}s", file=sys.stderr, flush=True)
        tenants[name] = Tenant(name=name, workspace=ws, root=ws.root if ws is not None else None)
    return _state(config, backend, tenants, router, owned)


def _tenant_roots(config: ServerConfig, repo: str | Path | None, default_tenant: str) -> list[tuple[str, Path | None]]:
    """Each tenant's workspace folder, resolved (its own, else ``repo``, else None): the config's
    tenants, or the one ``default_tenant`` when it names none."""
    out = []
    for name, ws in [(t.name, t.workspace) for t in config.tenants or []] or [(default_tenant, None)]:
        root = ws if ws is not None else repo
        out.append((name, Path(root).resolve() if root is not None else None))
    return out


def _state(config: ServerConfig, backend: Any, tenants: dict[str, Tenant], router: Router,
           owned: tuple) -> ServerState:
    """The server state around a started backend and its tenants: their keys, the per-tenant
    log sink and the metrics. A failure here closes the backend (and the tenants' workspaces)."""
    from ..telemetry import Metrics, TenantLogSink

    cfg = config.server
    try:
        sink = TenantLogSink(cfg.log_dir, max_bytes=cfg.log_max_bytes, backups=cfg.log_backups)
        metrics = Metrics(max_tenants=cfg.metrics_max_tenants)
    except BaseException:
        for t in tenants.values():
            if t.workspace is not None:
                t.workspace.close()
        backend.close()   # an engine's processes and threads do not outlive a failed start
        raise
    keys = {k: t.name for t in config.tenants or [] for k in t.api_keys}
    return ServerState(backend=backend, config=config, tenants=tenants, router=router, sink=sink,
                       metrics=metrics, model_id=backend.model_name, require_key=bool(config.tenants), keys=keys,
                       owned=owned)


# [server] keys the SGLang backend cannot honour (SGLang batches, queues and caches prefixes
# itself; the model comes from --model): a config that sets one is refused, not ignored
SGLANG_REFUSED = {
    "model": "pass the Hugging Face folder as --model (sglang_options['model'])",
    "max_batch": "SGLang batches by its own max_running_requests (--sglang-arg max_running_requests=N)",
    "budget_policy": "SGLang's speculation verifies its fixed draft width (--draft-tokens)",
    "prefix_cache_bytes": "SGLang's radix cache holds prefixes (--sglang-arg mem_fraction_static=F)",
    "prefix_cache_shared": "SGLang's radix cache is shared by every request",
}


def check_sglang_config(config: ServerConfig) -> None:
    """ConfigError naming each ``[server]`` key set away from its default that the SGLang backend
    cannot honour (``SGLANG_REFUSED``), with what to use instead."""
    from ..config import ServerSection

    default = ServerSection()
    bad = [k for k in SGLANG_REFUSED if getattr(config.server, k) != getattr(default, k)]
    if bad:
        raise ConfigError("[server] " + "; ".join(f"{k} = {getattr(config.server, k)!r} does not apply to "
                                                   f"--backend sglang: {SGLANG_REFUSED[k]}" for k in bad))


def _build_sglang_state(config: ServerConfig, *, repo: str | Path | None, engine: Any, options: dict | None,
                        watch: bool, quiet: bool, default_tenant: str, owned: tuple = ()) -> ServerState:
    from agentspec.integrations.sglang.backend import SGLangBackend

    check_sglang_config(config)
    opts = dict(options or {})
    model = opts.pop("model", None)
    if model is None:
        raise ConfigError("the SGLang backend needs a model: a Hugging Face folder (--model PATH)")
    cfg = config.server
    router = Router(config.routes)
    route_drafters = {f"route {r.name!r}": r.drafters for r in router.configured()
                      if r.spec is not None and r.drafters is not None}
    roots = dict(_tenant_roots(config, repo, default_tenant))
    opts.setdefault("max_queue", cfg.max_queue)
    backend = SGLangBackend(model, tenants={n: (str(r) if r is not None else None) for n, r in roots.items()},
                            watch=watch, model_name=cfg.model_name, drafters=route_drafters, engine=engine,
                            quiet=quiet, exclude=[(o.rule, str(o.path)) for o in owned], **opts)
    if not quiet:
        for name, root in roots.items():
            if root is not None:
                print(f"[agentspec] tenant {name!r}: workspace {root} (indexed by SGLang's scheduler processes)",
                      file=sys.stderr, flush=True)
    tenants = {name: Tenant(name=name, workspace=None, root=root) for name, root in roots.items()}
    return _state(config, backend, tenants, router, owned)
