"""Tests of the SGLang CPU test infrastructure (tests/sglang/standin); they run only in
.venv-sglang: `make test-sglang` runs scripts/setup_sglang.sh, then pytest on this directory.
Elsewhere each module is skipped with the reason (``helpers.sglang.require_sglang``)."""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path

import pytest

HERE = Path(__file__).parent
AVAILABLE = importlib.util.find_spec("sglang") is not None and importlib.util.find_spec("sgl_kernel") is not None

if AVAILABLE:
    # SGLang takes its CPU path only with this set (sglang.srt.utils.common.is_cpu, read at import).
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    # test_standin.py runs the wheel's own Triton kernels in Triton's CPU interpreter as references.
    # Triton decides that when a kernel is decorated, i.e. when its module is imported (triton's own
    # tl.cdiv & co. included): so TRITON_INTERPRET is set only while importing them here, and
    # engine processes spawned later by tests do not inherit it. The project runs pytest with
    # filterwarnings=error, and SGLang warns a lot at import time (AWQ / GGUF unsupported on CPU,
    # deprecations): hence the quiet imports.
    _saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import triton.language  # noqa: F401
            import sgl_kernel  # noqa: F401
            import sglang.kernels.ops.speculative.cache_locs  # noqa: F401
            import sglang.kernels.ops.speculative.eagle  # noqa: F401
            import sglang.kernels.ops.speculative.reconstruct_tree  # noqa: F401
            import sglang.kernels.ops.speculative.spec_tree  # noqa: F401
            import sglang.srt.mem_cache.allocation  # noqa: F401
            import sglang.srt.speculative.ngram_worker  # noqa: F401
    finally:
        if _saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _saved


def pytest_collection_modifyitems(config, items):
    # SGLang's own warnings (deprecations, "not supported on CPU") are not what these tests check
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.filterwarnings("ignore"))
