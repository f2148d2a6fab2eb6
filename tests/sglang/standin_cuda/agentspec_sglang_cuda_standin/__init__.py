"""SGLang plugin (entry point group ``sglang.srt.plugins``) of the agentspec CUDA stand-in.

SGLang 0.5.23's CUDA path compiles some kernels at first use (tvm-ffi + nvcc), one of them needing
FlashInfer's headers, and resolves others from ``flashinfer``. With the ``sgl_kernel`` stand-in
beside this package and no FlashInfer, ``install()`` points those lookups at torch or at the wheel's
own Triton kernels, in every SGLang process (``load_plugins()`` runs ``load`` in the engine,
scheduler and detokenizer processes before the server arguments are resolved):

* ``sglang.kernels.ops.speculative.tree._jit_tree_module`` -> ``ops.TRITON_TREE_MODULE``
  (EAGLE's ``build_tree_kernel_efficient``, greedy ``verify_tree_greedy``, NGRAM's
  ``reconstruct_indices_from_tree_mask``);
* ``sglang.kernels.ops.speculative.sampling._jit_sampling_module`` -> ``ops.TORCH_SAMPLING_MODULE``
  (sampled verification, ``tree_speculative_sampling_target_only``);
* ``sglang.kernels.ops.sampling.renorm.top_k_renorm_prob`` / ``top_p_renorm_prob`` (lazy
  ``flashinfer.sampling`` imports) -> the wheel's Triton renorm kernels;
* ``sglang.srt.mem_cache.memory_pool.can_use_store_cache`` -> False: the KV cache is written with
  torch indexing instead of the JIT ``store_cache`` kernel;
* ``sglang.srt.layers.dual_gemm.DualGemm._select_mode`` -> None off SM100 without importing the CuTe
  DSL kernel module (``cutlass``, absent here): every MLP's constructor asks it on CUDA, and its
  own answer off SM100 is None too (``can_use_dual_gemm`` requires SM100).

Each patch is applied when its module is first imported (or at once if it already is), so loading
the plugin imports nothing heavy. ``load`` also sets the environment switches the stand-in relies
on, unless they are set: ``SGLANG_FORCE_FUSED_OP_BACKEND=torch`` (RMSNorm, SiluAndMul and rotary
embedding in torch), ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python`` (the Rust radix tree is
built for CPython 3.11 only) and ``SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1`` (the stand-in is not
the ``sglang-kernel`` distribution). It does nothing unless the importable ``sgl_kernel`` is the
stand-in.
"""

from __future__ import annotations

import importlib.abc
import logging
import os
import sys

from . import ops

logger = logging.getLogger(__name__)

ENV_SWITCHES = {
    "SGLANG_FORCE_FUSED_OP_BACKEND": "torch",
    "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python",
    "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",
}


def _patch_tree(module) -> None:
    module._jit_tree_module = lambda: ops.TRITON_TREE_MODULE


def _patch_sampling(module) -> None:
    module._jit_sampling_module = lambda vec_size, deterministic: ops.TORCH_SAMPLING_MODULE


def _patch_renorm(module) -> None:
    # On CUDA both names are sglang.utils.LazyImport("flashinfer.sampling", ...) objects, shared by
    # every `from ... import` of them (eagle_utils, sampler, dflash_utils): resolving the lazy
    # object itself covers all of them.
    for name, fn in (("top_k_renorm_prob", ops.top_k_renorm_prob), ("top_p_renorm_prob", ops.top_p_renorm_prob)):
        value = getattr(module, name, None)
        if value is not None and hasattr(value, "_module") and hasattr(value, "module_name"):
            value._module = fn
        else:
            setattr(module, name, fn)


def _patch_memory_pool(module) -> None:
    module.can_use_store_cache = lambda *args, **kwargs: False


def _patch_dual_gemm(module) -> None:
    original = module.DualGemm._select_mode
    if getattr(original, "agentspec_standin", False):
        return

    def _select_mode(self, gate_up_proj, hidden_size):
        from sglang.srt.utils import is_sm100_supported

        if not is_sm100_supported():
            return None
        return original(self, gate_up_proj, hidden_size)

    _select_mode.agentspec_standin = True
    module.DualGemm._select_mode = _select_mode


PATCHES = {
    "sglang.kernels.ops.speculative.tree": _patch_tree,
    "sglang.kernels.ops.speculative.sampling": _patch_sampling,
    "sglang.kernels.ops.sampling.renorm": _patch_renorm,
    "sglang.srt.mem_cache.memory_pool": _patch_memory_pool,
    "sglang.srt.layers.dual_gemm": _patch_dual_gemm,
}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name):   # get_source, get_filename, ... of the real loader
        return getattr(self._loader, name)


class _PostImportPatcher(importlib.abc.MetaPathFinder):
    """Finds the patched modules with the other finders, then patches each once it has run."""

    def find_spec(self, name, path, target=None):
        patch = PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


_installed = False


def standin_active() -> bool:
    try:
        import sgl_kernel
    except Exception:
        return False
    return bool(getattr(sgl_kernel, "AGENTSPEC_CUDA_STANDIN", False))


def install() -> None:
    """Apply every patch (now to modules already imported, at import to the others). Idempotent."""
    global _installed
    if _installed:
        return
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, _PostImportPatcher())
    _installed = True


def load() -> None:
    """The entry point SGLang calls: the environment switches, then ``install()``."""
    if not standin_active():
        return
    for key, value in ENV_SWITCHES.items():
        os.environ.setdefault(key, value)
    install()
    logger.info("agentspec CUDA stand-in: tree ops -> Triton, sampled verification -> torch, "
                "renorm -> Triton, store_cache off, dual GEMM off SM100 (%s)", ", ".join(f"{k}={os.environ[k]}" for k in ENV_SWITCHES))
