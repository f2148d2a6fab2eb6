"""SGLang plugin (entry point group ``sglang.srt.plugins``) of the agentspec CPU stand-in.

SGLang rewrites ``attention_backend="intel_amx"`` to ``torch_native`` on a CPU without AMX
(``sglang.srt.arg_groups.overrides._attention_backend_platform_fallbacks`` reads
``get_platform().has_amx``), and torch_native cannot run NGRAM's TARGET_VERIFY forward. The
intel_amx backend only needs the two attention ops the ``sgl_kernel`` stand-in provides, so this
plugin declares the platform fact ``has_amx=True`` through SGLang's own override API. It touches
nothing else: ``cpu_has_amx_support()`` (which gates the fused AMX linear/norm kernels) keeps
probing the real machine and stays False, because the stand-in has no ``convert_weight_packed``.

``load_plugins()`` runs this in every SGLang process (engine, scheduler, detokenizer) before the
server arguments are resolved. It is a no-op unless the importable ``sgl_kernel`` is the stand-in.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def standin_active() -> bool:
    try:
        import sgl_kernel
    except Exception:
        return False
    return bool(getattr(sgl_kernel, "AGENTSPEC_STANDIN", False))


def load() -> None:
    if not standin_active():
        return
    from sglang.srt.runtime_context import get_platform, override_platform

    if not get_platform().has_amx:
        override_platform(has_amx=True).install()
        logger.info("agentspec CPU stand-in: platform fact has_amx=True (keeps intel_amx attention)")
