"""Step-cost profiles cached on disk, per machine, build and model.

The step-cost profile (``step_profile``: the engine's row cost and the batch scheduler's
step-cost curve) times forwards on this machine: seconds to minutes of a silent start on a
loaded 2-core machine, and a different number at every start. It is cached here as small JSON
files under ``$AGENTSPEC_CACHE_DIR/profiles`` (default ``$XDG_CACHE_HOME/agentspec/profiles`` or
``~/.cache/agentspec/profiles``), keyed by everything that changes the numbers: the machine
(``agentspec.kernels.cpu_isa.machine_info()``: CPU model, flags, kernel ISA, usable CPUs), the
torch version and thread count, the model file (path, size, mtime), dtype, KV dtype, device, the
native kernels' build (``agentspec.kernels._cpu``: file size, mtime, ABI version), the
``AGENTSPEC_CPU_*`` / ``OMP_*`` (and similar) switches and the measurement's own parameters.

A file whose key differs (hash collision, other build) or that cannot be read or parsed is a
miss: the caller measures again and overwrites it. Files are written to a temporary file,
fsynced and renamed (``os.replace``), so a crash never leaves a half-written profile. Delete the
folder to re-measure; ``AGENTSPEC_NO_PROFILE_CACHE=1`` turns the cache off (always measure, never
store).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

from suffix_index.atomic import write_atomic

__all__ = ["FORMAT", "cache_dir", "enabled", "engine_key", "load", "path_for", "store",
           "valid_row_context_cost", "valid_step_costs"]

FORMAT = 2  # bump when the key or the stored value changes meaning
KEEP = 64   # profiles kept per folder (each ~1 KB); older ones go when a new one is stored


def enabled() -> bool:
    """False when ``AGENTSPEC_NO_PROFILE_CACHE`` is set to anything but ``""`` / ``0``."""
    return os.environ.get("AGENTSPEC_NO_PROFILE_CACHE", "").strip() in ("", "0")


def cache_dir() -> Path:
    """``<agentspec cache root>/profiles`` (the root: ``$AGENTSPEC_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/agentspec``, else ``~/.cache/agentspec``)."""
    from .weights import cache_root

    return cache_root() / "profiles"


# ---- the key ---------------------------------------------------------------------------------


def _machine() -> dict:
    try:
        from ...kernels import cpu_isa

        return cpu_isa.machine_info()  # its "isa" is the active level
    except Exception as e:  # noqa: BLE001 - the key then says so; never fail a start over it
        return {"machine": platform.machine(), "processor": platform.processor(), "cpu_isa_error": repr(e)}


def _native() -> dict | None:
    """Identity of the compiled kernels (a rebuild changes the numbers); None without them."""
    try:
        from ...kernels import _cpu  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001
        return None
    out: dict[str, Any] = {}
    path = getattr(_cpu, "__file__", None)
    if path:
        try:
            st = os.stat(path)
            out.update(file=os.path.realpath(path), size=st.st_size, mtime_ns=st.st_mtime_ns)
        except OSError:
            out["file"] = str(path)
    abi = getattr(_cpu, "abi_version", None)
    if callable(abi):
        try:
            out["abi"] = abi()
        except Exception:  # noqa: BLE001
            pass
    return out


def _model_files(source: str | os.PathLike | None) -> dict:
    """Path, size and mtime of the model file (a folder: of each file directly inside it)."""
    if source is None:
        return {"path": None}
    p = Path(source).expanduser()
    try:
        p = p.resolve()
        if p.is_dir():
            files = sorted((c.name, c.stat()) for c in p.iterdir() if c.is_file())
            return {"path": str(p), "files": [[n, st.st_size, st.st_mtime_ns] for n, st in files]}
        st = p.stat()
        return {"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    except OSError:
        return {"path": str(p), "missing": True}


def _device(device: Any) -> dict:
    import torch

    dev = torch.device(device)
    out: dict[str, Any] = {"device": str(dev)}
    if dev.type == "cuda":
        try:
            out["name"] = torch.cuda.get_device_name(dev)
            out["cuda"] = torch.version.cuda
        except Exception:  # noqa: BLE001
            pass
    return out


# environment variables that change kernel choice or threading, hence the timings
_SWITCHES = ("AGENTSPEC_CPU_", "OMP_", "GOMP_", "KMP_", "MKL_", "DNNL_", "ONEDNN_")


def engine_key(kind: str, engine: Any, **params: Any) -> dict:
    """The cache key of profile ``kind`` for ``engine`` (an ``EmbeddedEngine``: ``model_path``,
    ``dtype``, ``kv_dtype``, ``device``); ``params``: the measurement's own parameters."""
    import torch

    key = {
        "format": FORMAT,
        "kind": kind,
        "params": params,
        "machine": _machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "native": _native(),
        "switches": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_SWITCHES)},
        "model": _model_files(getattr(engine, "model_path", None)),
        "dtype": str(engine.dtype).removeprefix("torch."),
        # the kernel plan at this ISA level (plan.KernelPlan: every kernel of a forward)
        "kernel_plan": plan.to_dict() if (plan := getattr(engine, "plan", None)) is not None else None,
        "kv_dtype": str(engine.kv_dtype).removeprefix("torch."),
        **_device(engine.device),
    }
    return _jsonable(key)


def _jsonable(obj: Any) -> Any:
    """``obj`` as it reads back from JSON (tuples become lists, other objects strings)."""
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def path_for(key: dict) -> Path:
    text = json.dumps(_jsonable(key), sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(text.encode()).hexdigest()[:20]
    kind = "".join(c if c.isalnum() or c in "-_" else "_" for c in str(key.get("kind", "profile")))
    return cache_dir() / f"{kind}-{digest}.json"


# ---- read and write ----------------------------------------------------------------------------


def load(key: dict, validate: Callable[[Any], Any] | None = None) -> Any | None:
    """The value stored under ``key``, or None: no cache, no file, another key, a file that does
    not parse, or a value ``validate`` rejects (returns None or raises). Never raises."""
    if not enabled():
        return None
    try:
        with open(path_for(key), encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != _jsonable(key):
            return None
        value = data.get("value")
        return validate(value) if validate is not None else value
    except Exception:  # noqa: BLE001 - unreadable, truncated, foreign: measure again
        return None


def store(key: dict, value: Any) -> Path | None:
    """Write ``value`` under ``key`` atomically (``suffix_index.atomic.write_atomic``); returns
    the path, or None when the cache is off or not writable (never raises)."""
    if not enabled():
        return None
    try:
        path = path_for(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"format": FORMAT, "key": _jsonable(key), "value": value}, sort_keys=True,
                                      indent=1))
        _prune(path.parent, keep=KEEP)
        return path
    except Exception:  # noqa: BLE001 - a read-only or full disk must not fail a start
        return None


def _prune(folder: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest profiles (each build or key change leaves one behind)."""
    try:
        files = sorted(folder.glob("*.json"), key=lambda f: f.stat().st_mtime_ns, reverse=True)
        for f in files[keep:]:
            f.unlink(missing_ok=True)
    except OSError:
        pass


# ---- value checks --------------------------------------------------------------------------------


def valid_row_context_cost(value: Any) -> float | None:
    """A row's attention cost per token of context, stored as seconds: finite, >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def valid_step_costs(value: Any) -> dict[int, float] | None:
    """A step-cost profile stored as ``[[rows, seconds], ...]``: at least two points, rows
    distinct positive integers, seconds finite and positive."""
    if not isinstance(value, list) or len(value) < 2:
        return None
    out: dict[int, float] = {}
    for item in value:
        if not isinstance(item, list) or len(item) != 2:
            return None
        n, s = item
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n in out:
            return None
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
            return None
        out[n] = float(s)
    return out
