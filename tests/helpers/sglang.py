"""What the SGLang tests share: the model folder, engine arguments, real prompts."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

SKIP_REASON = ("SGLang is not installed in this venv: `make test-sglang` sets up .venv-sglang (SGLang on CPU with "
               "the stand-in kernels) and runs these tests")
AVAILABLE = importlib.util.find_spec("sglang") is not None and importlib.util.find_spec("sgl_kernel") is not None


def require_sglang() -> None:
    """Skip the calling test module, with the reason, where SGLang is not installed."""
    if not AVAILABLE:
        pytest.skip(SKIP_REASON, allow_module_level=True)


ROOT = Path(__file__).resolve().parents[2]
MODEL = Path(os.environ.get("AGENTSPEC_SGLANG_MODEL", ROOT / ".venv-sglang" / "models" / "SmolLM2-135M-Instruct"))
# the shipped sample (benchmarks/data: recorded rewrites, synthetic agent turns); $AGENTSPEC_DATA: a folder
# of the full recorded sets instead
DATA = Path(os.environ.get("AGENTSPEC_DATA", ROOT / "benchmarks" / "data"))


def engine_kwargs(**extra):
    kw = dict(model_path=str(MODEL), device="cpu", dtype="float32", attention_backend="intel_amx",
              max_total_tokens=8192, max_running_requests=4, mem_fraction_static=0.3, log_level="error")
    kw.update(extra)
    return kw


def real_prompts() -> dict[str, list[list[int]]]:
    """4 file rewrites and 4 agent turns from ``DATA`` (held-out records, prompts of at most 700
    tokens), tokenized with the model's chat template."""
    spec = importlib.util.spec_from_file_location("benchmarks_harness", ROOT / "benchmarks" / "harness.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    agent_prompts, first_record, rewrite_prompts = harness.agent_prompts, harness.first_record, harness.rewrite_prompts

    from agentspec.backends.embedded.engine import EmbeddedEngine

    tok = EmbeddedEngine(quiet=True)
    return {"rewrites": rewrite_prompts(tok, DATA, 4, 700, first_record(DATA, 200)),
            "agent": agent_prompts(tok, DATA, 4, 700, first_record(DATA, 150))}
