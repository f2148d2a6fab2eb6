"""Import SGLang's CUDA path with the sgl_kernel stand-in and check each of the stand-in's patches.

    python benchmarks/gpu/kit/import_check.py [--fake-cuda] [--out FILE]

The modules a Llama-family target, the Triton attention backend, NGRAM / EAGLE3 and agentspec's
AGENTSPEC / AGENTSPEC_EAGLE3 workers load on CUDA, imported in one process with the stand-in
(tests/sglang/standin_cuda) as ``sgl_kernel``; then: every lookup the stand-in's plugin patches
resolves to torch or Triton, the environment switches are set, agentspec's algorithms register.
Prints (and writes to --out) a JSON record; exits 1 naming the first check that failed.

``--fake-cuda`` (a dry run on a machine without a GPU) makes torch report one CUDA device of
compute capability 9.0 before SGLang is imported, so that SGLang takes its CUDA branches at import
time; nothing is run on a device.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import warnings

MODULES = [
    "sglang.srt.entrypoints.engine",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tp_worker",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.llama",
    "sglang.srt.models.llama_eagle3",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.layernorm",
    "sglang.srt.layers.sampler",
    "sglang.srt.batch_invariant_ops",
    "sglang.srt.speculative.ngram_worker",
    "sglang.srt.speculative.eagle_worker_v2",
    "sglang.srt.speculative.eagle_utils",
    "sglang.kernels.ops.speculative.verify_sampling",
    "sglang.kernels.ops.sampling.renorm",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.layers.dual_gemm",
    "agentspec.integrations.sglang.worker",
    "agentspec.integrations.sglang.hybrid",
    "agentspec.integrations.sglang.backend",
]


def fake_cuda() -> None:
    import torch

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: "fake CUDA device (dry run)"
    torch.version.cuda = torch.version.cuda or "13.0"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fake-cuda", action="store_true", help="dry run without a GPU (see above)")
    ap.add_argument("--out", help="also write the JSON record here")
    args = ap.parse_args(argv)
    os.environ.pop("SGLANG_USE_CPU_ENGINE", None)   # SGLang's CPU path would take other branches
    warnings.simplefilter("ignore")
    record: dict = {"fake_cuda": args.fake_cuda, "checks": {}}

    def check(name: str, ok: bool, detail="") -> None:
        record["checks"][name] = {"ok": bool(ok), **({"detail": str(detail)} if detail else {})}
        if not ok:
            raise SystemExit(f"import_check: {name} failed {detail}")

    try:
        if args.fake_cuda:
            fake_cuda()
        import sgl_kernel

        check("sgl_kernel is the CUDA stand-in", getattr(sgl_kernel, "AGENTSPEC_CUDA_STANDIN", False),
              getattr(sgl_kernel, "__file__", ""))
        import agentspec_sglang_cuda_standin as standin

        standin.load()   # what SGLang's load_plugins() runs in each of its processes
        for key, value in standin.ENV_SWITCHES.items():
            check(f"env {key}", os.environ.get(key) == value, os.environ.get(key))
        t0 = time.perf_counter()
        for name in MODULES:
            try:
                importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 - reported as the failed check
                check(f"import {name}", False, f"{type(e).__name__}: {e}")
        record["import_s"] = round(time.perf_counter() - t0, 1)
        check("imports", True)

        from sglang.kernels.ops.sampling import renorm
        from sglang.kernels.ops.speculative import sampling, tree
        from sglang.srt.mem_cache import memory_pool
        from sglang.srt.utils import is_cpu, is_cuda

        ops = standin.ops
        check("SGLang takes its CUDA path", is_cuda() and not is_cpu())
        check("tree ops -> Triton", tree._jit_tree_module() is ops.TRITON_TREE_MODULE)
        check("sampled verification -> torch", sampling._jit_sampling_module(4, True) is ops.TORCH_SAMPLING_MODULE)
        check("top_k_renorm_prob -> Triton", renorm.top_k_renorm_prob._load() is ops.top_k_renorm_prob)
        check("top_p_renorm_prob -> Triton", renorm.top_p_renorm_prob._load() is ops.top_p_renorm_prob)
        check("store_cache off", memory_pool.can_use_store_cache(1152) is False)
        from sglang.srt.layers import dual_gemm
        from sglang.srt.utils import is_sm100_supported

        if not is_sm100_supported():   # the CuTe DSL kernel module (cutlass) is never imported
            check("dual GEMM off SM100", dual_gemm.DualGemm._select_mode(None, None, 576) is None)

        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        from agentspec.integrations.sglang.plugin import load as load_agentspec

        load_agentspec()
        a, h = SpeculativeAlgorithm.from_string("AGENTSPEC"), SpeculativeAlgorithm.from_string("AGENTSPEC_EAGLE3")
        check("AGENTSPEC registers as NGRAM-like", a.is_ngram() and not a.has_draft_kv(), repr(a))
        check("AGENTSPEC_EAGLE3 registers as EAGLE3-like", h.is_eagle3(), repr(h))
        import sglang
        import torch

        record.update(sglang=sglang.__version__, torch=torch.__version__, python=sys.version.split()[0],
                      sgl_kernel=sgl_kernel.__file__)
        record["ok"] = True
        code = 0
    except SystemExit as e:
        record["ok"] = False
        record["error"] = str(e)
        code = 1
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
