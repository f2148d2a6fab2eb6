"""The kernel plan: which kernel runs each part of a forward, chosen in one place.

A forward of the embedded engine has two kinds of rows: **prefill rows** (a prompt's chunks:
causal, many rows) and **decode / verify rows** (each request's last token and its draft tree, 1
to ``MAX_STEP_ROWS`` rows per request, several requests in one forward). For each kind the plan
names the kernel of every part of a layer (the projections, the norms, the attention) and of the
output head. ``Transformer`` runs what the plan says and never asks the CPU, the dtype or the
environment itself; ``EmbeddedEngine.kernel_info()`` and the start-up line print the plan.

The plan is a function of the machine (``Facts``: the native extension, AMX, the ISA level the
kernels run at now), the model (dtype, KV dtype, head sizes, which weights the AMX kernels take)
and the settings below, read from the environment here and nowhere else (``Settings.from_env``;
tests and benchmarks pass their own ``Settings``):

==============================  ==================================================================
``AGENTSPEC_CPU_ISA``           cap on the native kernels' ISA level (``cpu_isa``; read by the engine)
``AGENTSPEC_CPU_ATTENTION=0``   no native attention (torch's for every row)
``AGENTSPEC_CPU_FUSED=0``       native attention without the fused ``QKVAttention`` (rotary and
                                cache writes in torch)
``AGENTSPEC_CPU_LINEAR=0``      no native linears (torch's GEMM for decode rows too)
``AGENTSPEC_DECODE_ATTENTION``  decode / verify attention: ``amx`` (default, where AMX runs) or ``rows``;
                                ``float32``: layered rows keep the float32 kernel (no bfloat16 products)
``AGENTSPEC_DECODE_LINEARS``    decode / verify projections: ``amx`` (default, where AMX runs) or ``vector``
``AGENTSPEC_PREFILL_ATTENTION`` prompt attention: ``amx`` (default where AMX runs, else ``sdpa``),
                                ``sdpa`` or ``blockwise``
==============================  ==================================================================

Adding a kind of linear (a quantized one) or a device is a new value of a field here and its
kernel in ``kernels/``; nothing else branches on the hardware.

The ISA level can change while an engine lives (``cpu_isa.set_isa``: tests compare the levels on
one engine), and the AMX kernels run only at the top level, so ``Transformer`` asks for the plan
of the level active now (``KernelPlan.choose`` is cheap and cached per level).
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass, replace

import torch

__all__ = ["DECODE_ATTENTION_MODES", "DECODE_LINEAR_MODES", "PREFILL_ATTENTION_MODES", "Facts", "KernelPlan",
           "Settings"]

DECODE_ATTENTION_MODES = ("amx", "rows", "float32")
DECODE_LINEAR_MODES = ("amx", "vector")
PREFILL_ATTENTION_MODES = ("amx", "native", "sdpa", "blockwise")


def _choice(env: str, default: str, allowed: tuple[str, ...]) -> str:
    value = os.environ.get(env, default)
    if value not in allowed:
        raise ValueError(f"{env}={value!r}: expected one of {', '.join(allowed)}")
    return value


@dataclass(frozen=True)
class Settings:
    """What the environment (or a test) asks of the kernels; ``KernelPlan.choose`` decides."""

    native_attention: bool = True     # AGENTSPEC_CPU_ATTENTION
    fused: bool = True                # AGENTSPEC_CPU_FUSED
    native_linears: bool = True       # AGENTSPEC_CPU_LINEAR
    decode_attention: str = "amx"     # AGENTSPEC_DECODE_ATTENTION: amx | rows | float32 (layered rows: no
                                      # bfloat16 products)
    decode_linears: str = "amx"       # AGENTSPEC_DECODE_LINEARS: amx | vector
    prefill_attention: str = "amx"    # AGENTSPEC_PREFILL_ATTENTION: amx | native | sdpa | blockwise

    @classmethod
    def from_env(cls) -> Settings:
        """The environment's settings (a bad value raises ValueError naming the variable)."""
        return cls(native_attention=os.environ.get("AGENTSPEC_CPU_ATTENTION", "1") != "0",
                   fused=os.environ.get("AGENTSPEC_CPU_FUSED", "1") != "0",
                   native_linears=os.environ.get("AGENTSPEC_CPU_LINEAR", "1") != "0",
                   decode_attention=_choice("AGENTSPEC_DECODE_ATTENTION", "amx", DECODE_ATTENTION_MODES),
                   decode_linears=_choice("AGENTSPEC_DECODE_LINEARS", "amx", DECODE_LINEAR_MODES),
                   prefill_attention=_choice("AGENTSPEC_PREFILL_ATTENTION", "amx", PREFILL_ATTENTION_MODES))

    def with_(self, **changes) -> Settings:
        return replace(self, **changes)


@dataclass(frozen=True)
class Facts:
    """The machine, as the kernels see it now."""

    extension: bool        # agentspec.kernels._cpu is built
    linear_kernels: bool   # ... with the bfloat16 linears
    amx: bool              # AMX-BF16 usable (CPU and OS)
    isa: str               # the level the native kernels run at now (cpu_isa.active())
    top_isa: bool          # that level is avx512bf16 (the AMX kernels run only there)

    @classmethod
    def now(cls) -> Facts:
        """The facts at the ISA level the kernels run at now (one C call; the rest is cached)."""
        from ...kernels.cpu_attention import _cpu

        return _facts_at(-1 if _cpu is None else _cpu.isa())


@functools.lru_cache(maxsize=None)
def _facts_at(level: int) -> Facts:
    from ...kernels import cpu_isa
    from ...kernels.cpu_attention import _cpu

    if _cpu is None:
        return Facts(extension=False, linear_kernels=False, amx=False, isa="scalar", top_isa=False)
    return Facts(extension=True, linear_kernels=hasattr(_cpu, "linear_bf16"), amx=bool(_cpu.prefill_amx_available()),
                 isa=cpu_isa.ISA_LEVELS[level], top_isa=level == 4)


def _fallbacks(*, cpu: bool, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, group: int, native: bool,
               fused: bool, packed: bool, amx_top: bool, amx_weights: bool, head_k: int, gemm_f32: bool,
               settings: Settings, facts: Facts, rows_linears: str, prefill_attention: str,
               quantized: bool = False) -> tuple[str, ...]:
    """Why each part the plan gives a slower kernel than this machine's best runs that one (only
    shapes, dtypes and the extension: a setting that asks for a kernel is not a reason to report)."""
    if not cpu:
        return ()
    from ...kernels.cpu_attention import FLOAT32_HEAD_DIMS

    out = []
    if not facts.extension:
        return ("native kernels: agentspec.kernels._cpu is not built (re-run scripts/setup.sh)",)
    bf16 = dtype == torch.bfloat16
    if settings.native_attention and head_dim not in FLOAT32_HEAD_DIMS:
        out.append(f"native attention: head_dim {head_dim} has no native kernel yet (64, 128): torch attention")
    elif settings.native_attention and settings.fused and not fused and head_dim != 64 and bf16 \
            and kv_dtype == torch.float32:
        out.append(f"fused rows: head_dim {head_dim} (the fused bfloat16 kernels take 64): layered rows, "
                   "native attention")
    if settings.native_attention and settings.fused and not fused and head_dim == 64:
        if not bf16:
            out.append(f"fused rows: the model runs in {str(dtype).removeprefix('torch.')} (fused: bfloat16)")
        elif kv_dtype != torch.float32:
            out.append(f"fused rows: a {str(kv_dtype).removeprefix('torch.')} KV cache (fused: float32)")
        elif not 0 < group <= 8:
            out.append(f"native attention: {group or 'uneven'} query heads per kv head (native: 1-8): torch attention")
    if quantized and amx_top:
        out.append("quantized linears: AMX-INT8 tiles take prompt chunks of Q6_K weights only (other types, decode "
                   "and verification rows: the VNNI body); prompt attention on SDPA, not AMX tiles")
    if bf16 and not packed and facts.linear_kernels and settings.native_linears:
        out.append("native linears: the projections' shapes have no packed kernel: torch linears")
    if amx_top and rows_linears == "vector" and settings.decode_linears == "amx":
        if not fused:
            out.append("AMX decode linears: they run on the fused rows path only")
        elif gemm_f32:
            out.append("AMX decode linears: the model multiplies in float32")
        elif not amx_weights or head_k % 32:
            out.append("AMX decode linears: a projection's shape does not take the AMX tiles")
    if amx_top and bf16 and prefill_attention == "sdpa" and settings.prefill_attention == "amx" \
            and settings.native_attention and not gemm_f32:
        if head_dim != 64:
            out.append(f"AMX prefill: head_dim {head_dim} (64 only)")
        elif not 0 < group <= 4:
            out.append(f"AMX prefill: {group or 'uneven'} query heads per kv head (AMX prefill: 1-4)")
    return tuple(out)


@dataclass(frozen=True)
class KernelPlan:
    """The kernels of a forward's parts. Values:

    - ``rows_path``: "fused" (``Block.forward_native``: one native call per layer does the rotary
      embedding, the cache writes and the attention, ``cpu_attention.QKVAttention``) or "layered"
      (``Block.forward``: torch for q/k/v, then the attention below);
    - ``rows_attention``: "amx" / "rows" (``QKVAttention``'s modes), "native" (the float32 kernel
      ``cpu_attention.decode_attention`` / ``segment_attention`` over a float32 or bfloat16 cache),
      "dot" (the same entry points' bfloat16-product mode: VDPBF16PS, for bfloat16 models on
      AVX512-BF16 CPUs) or "torch" (``small_attention``);
    - ``rows_linears``: "amx" (``PackedLinear.prefill``'s tiles), "vector" (``PackedLinear``),
      "quantized" (``cpu_quant.QuantLinear``: a GGUF file's weights kept quantized, its body in
      ``quant_body``) or "torch" (``F.linear``); ``rows_norms``: "native" (``cpu_attention.rms_norm``) or "torch";
    - ``head``: the output projection of decode / verify rows, as ``rows_linears`` (the packed head
      where there is one);
    - ``prefill_attention``: "amx" (AMX tiles over the packed cache), "native" (AVX512-BF16's
      VDPBF16PS over the cache: ``cpu_attention.prefill_bf16``), "sdpa" (torch's flash kernel),
      "blockwise" (``model.prefill_attention``) or "torch" (float32 SDPA over the cache);
    - ``prefill_linears``: "amx" (``Block.forward_amx``: AMX projections, native norms and rotary),
      "quantized" (as ``rows_linears``), "bfloat16" or "float32" (torch's GEMM in that dtype; float32 where the CPU has no bfloat16
      dot products: exact, and faster there);
    - ``kv_packed``: the KV cache keeps the packed bfloat16 copies the native kernels read.
    """

    device: str
    isa: str
    dtype: str
    kv_dtype: str
    kv_packed: bool
    rows_path: str
    rows_attention: str
    rows_linears: str
    rows_norms: str
    head: str
    prefill_attention: str
    prefill_linears: str
    weight_copies: int = 2
    # the quantized linears' body at this level ("amx-int8", "avx512vnni", "avx2", "neon", "scalar"; "" for
    # other linears)
    quant_body: str = ""
    # why a part runs a slower kernel than this machine's best for it: ("part: reason", ...)
    why: tuple[str, ...] = ()

    @staticmethod
    def choose(*, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, n_heads: int,
               n_kv_heads: int, packed: bool, amx_weights: bool, head_k: int, gemm_f32: bool, settings: Settings,
               facts: Facts, weight_copies: int = 2, quantized: bool = False) -> KernelPlan:
        """The plan for a model of ``dtype`` on ``device`` with a ``kv_dtype`` cache.

        ``packed``: the projections have packed copies (``Transformer.pack_linears``, which
        packs where ``linears_native`` says); ``amx_weights``: every projection's shape takes
        the AMX kernels; ``head_k``: the output head's input width; ``gemm_f32``: prompt
        projections multiply in float32 (``Transformer.set_gemm_float32``)."""
        from ...kernels.cpu_attention import CACHE_DTYPES, FLOAT32_HEAD_DIMS

        cpu = torch.device(device).type == "cpu"
        bf16 = dtype == torch.bfloat16
        group = n_heads // n_kv_heads if n_kv_heads and n_heads % n_kv_heads == 0 else 0
        native = facts.extension and settings.native_attention and cpu
        kv_packed = native and bf16 and kv_dtype == torch.float32 and head_dim == 64
        fused = kv_packed and settings.fused and 0 < group <= 8
        amx_top = facts.amx and facts.top_isa
        if fused:
            rows_attention = "amx" if settings.decode_attention == "amx" and amx_top else "rows"
        else:
            rows_attention = ("native" if native and kv_dtype in CACHE_DTYPES
                              and head_dim in FLOAT32_HEAD_DIMS and 0 < group <= 8 else "torch")
            if rows_attention == "native" and bf16 and facts.isa == "avx512bf16" \
                    and settings.decode_attention != "float32":
                # the bfloat16-product mode: the model's queries, keys and values are bfloat16
                # values, so only the weights' rounding is new (cpu_attention.decode_attention's dot)
                rows_attention = "dot"
        if quantized:
            rows_linears = "quantized"
        elif not packed:
            rows_linears = "torch"
        elif fused and amx_weights and not gemm_f32 and head_k % 32 == 0 and settings.decode_linears == "amx" \
                and amx_top:
            rows_linears = "amx"
        else:
            rows_linears = "vector"
        rows_norms = "native" if fused and (rows_attention == "amx" or rows_linears == "amx") else "torch"
        if bf16 and not gemm_f32:
            if (kv_packed and settings.prefill_attention == "amx" and settings.native_attention and amx_top
                    and 0 < group <= 4 and not quantized):
                prefill_attention = "amx"
            elif (settings.prefill_attention in ("amx", "native") and native and facts.isa == "avx512bf16"
                    and not facts.amx and kv_dtype in CACHE_DTYPES and head_dim in FLOAT32_HEAD_DIMS
                    and 0 < group <= 8):
                # VDPBF16PS flash kernel (cpu_attention.prefill_bf16); on AMX CPUs the shapes the AMX
                # kernel leaves keep SDPA, whose oneDNN GEMMs take the tiles (not measured against it)
                prefill_attention = "native"
            else:
                prefill_attention = "blockwise" if settings.prefill_attention == "blockwise" else "sdpa"
        else:
            prefill_attention = "torch"
        if quantized:
            prefill_linears = "quantized"
        elif prefill_attention == "amx" and amx_weights:
            prefill_linears = "amx"
        else:
            prefill_linears = "float32" if gemm_f32 else str(dtype).removeprefix("torch.")
        why = _fallbacks(cpu=cpu, dtype=dtype, kv_dtype=kv_dtype, head_dim=head_dim, group=group, native=native,
                         fused=fused, packed=packed, amx_top=amx_top, amx_weights=amx_weights, head_k=head_k,
                         gemm_f32=gemm_f32, settings=settings, facts=facts, rows_linears=rows_linears,
                         prefill_attention=prefill_attention, quantized=quantized)
        quant_body = ""
        if quantized:
            from ...kernels import cpu_quant

            quant_body = cpu_quant.body()
        return KernelPlan(device=str(torch.device(device)), isa=facts.isa if cpu else "-", dtype=str(dtype).removeprefix("torch."),
                          kv_dtype=str(kv_dtype).removeprefix("torch."), kv_packed=kv_packed,
                          rows_path="fused" if fused else "layered", rows_attention=rows_attention,
                          rows_linears=rows_linears, rows_norms=rows_norms,
                          head=rows_linears if packed else "torch", prefill_attention=prefill_attention,
                          prefill_linears=prefill_linears, weight_copies=weight_copies, quant_body=quant_body,
                          why=why)

    @property
    def fused(self) -> bool:
        return self.rows_path == "fused"

    @property
    def torch_linears(self) -> str:
        """Torch's GEMM for the model: "float32" (widened, see ``prefill_linears``) or its dtype."""
        return self.prefill_linears if self.prefill_linears != "amx" else self.dtype

    @property
    def layered_linears(self) -> str:
        """Decode / verify rows off the fused path (a cache without packed copies): the packed
        linears where there are any ("vector"), else torch's GEMM."""
        return "vector" if self.rows_linears in ("amx", "vector") else self.torch_linears

    @property
    def layered_attention(self) -> str:
        """Decode / verify rows off the fused path: the native float32-cache kernel where it runs
        ("native"), else torch's (``small_attention``)."""
        return "native" if self.rows_attention in ("amx", "rows", "native", "dot") else "torch"

    @property
    def rows_dot(self) -> bool:
        """Layered rows' native attention in its bfloat16-product mode ("dot")."""
        return self.rows_attention == "dot"

    @property
    def prefill_fallback(self) -> str:
        """A prompt chunk that cannot take the AMX path (its first position not a multiple of
        16, a cache without packed copies): SDPA's flash kernel, unless "blockwise" was asked;
        the plan's "native" kernel takes every chunk."""
        return "sdpa" if self.prefill_attention == "amx" else self.prefill_attention

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """One line for the start-up output."""
        q = f" {self.quant_body}" if self.quant_body else ""
        rows = (f"decode/verify rows: {self.rows_path} ({self.rows_attention} attention, {self.rows_linears}{q} linears, "
                f"{self.rows_norms} norms)")
        pre = f"prefill: {self.prefill_attention} attention, {self.prefill_linears}{q} linears"
        copies = ", one weight copy" if self.weight_copies == 1 else ""
        why = f" [{'; '.join(self.why)}]" if self.why else ""
        return (f"kernels at {self.isa}: {rows}; {pre}; KV {self.kv_dtype}{' packed' if self.kv_packed else ''}"
                f"{copies}{why}")

    def table(self) -> list[tuple[str, str]]:
        """(part, kernel) rows: the plan as a table (docs, notes, ``agentspec`` benchmarks)."""
        return [("decode/verify rows: q/k/v, rotary, cache writes", "native (fused)" if self.fused else "torch"),
                ("decode/verify rows: attention", self.rows_attention),
                ("decode/verify rows: projections (wqkv, wo, w_gate_up, w_down)", self.rows_linears),
                ("decode/verify rows: norms", self.rows_norms),
                ("decode/verify rows: output head", self.head),
                ("prefill rows: attention", self.prefill_attention),
                ("prefill rows: projections", self.prefill_linears),
                ("KV cache", f"{self.kv_dtype}{' + packed bf16 copies' if self.kv_packed else ''}"),
                ("weight copies", str(self.weight_copies))]
