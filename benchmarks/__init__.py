"""Benchmarks: scripts run from the repository root as ``python -m benchmarks.<script>`` (or
``python benchmarks/<script>.py``); what they share is in ``benchmarks.harness``.
``benchmarks/peers/`` holds runners for other virtual environments' pythons: standalone scripts,
not part of this package."""

import os as _os
import sys as _sys
from pathlib import Path as _Path

# Found through the repository root (``python -m benchmarks.X`` from there), the root then leaves
# sys.path, here and in every Python the benchmark starts (PYTHONSAFEPATH): its kernels/ and
# integrations/ folders install as agentspec.kernels and agentspec.integrations and would otherwise
# shadow the installed packages of those names (Hugging Face's `kernels`, which transformers imports).
_ROOT = _Path(__file__).resolve().parents[1]
_sys.path[:] = [p for p in _sys.path if _Path(p or _os.curdir).resolve() != _ROOT]
_os.environ["PYTHONSAFEPATH"] = "1"
