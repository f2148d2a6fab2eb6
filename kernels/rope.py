"""Rotary position embeddings: the inverse frequencies of every rope type the engine serves.

The formulas are transformers' (``modeling_rope_utils``), computed in float64:

- ``default``: ``1 / base ** (2i / d)``;
- ``linear``: the default divided by ``factor``;
- ``llama3`` (Llama 3.1+): long wavelengths divided by ``factor``, short ones kept, the band
  between ``original_max_position_embeddings / high_freq_factor`` and ``/ low_freq_factor``
  interpolated;
- ``yarn``: interpolation and extrapolation blended over a ramp between the ``beta_fast`` /
  ``beta_slow`` correction dimensions; cos and sin are scaled by an attention factor;
- ``dynamic`` (dynamic NTK) equals ``default`` up to ``max_position_embeddings`` tokens, past
  which transformers re-derives the base from each forward's length; the engine serves it with its
  context capped there (``families``), so ``default`` is exact;
- ``freq_factors``: llama.cpp's ``rope_freqs`` tensor (GGUF files of Llama 3.1+ store the
  ``llama3`` scaling as per-frequency divisors).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

__all__ = ["ROPE_TYPES", "apply_rope", "attention_factor", "inv_freq", "rope_cos_sin"]

# rope types the engine implements (``families`` refuses any other)
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def inv_freq(base: float, head_dim: int, scaling: Mapping | None = None,
             freq_factors: tuple[float, ...] = ()) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` float64 for rope ``base`` and ``scaling`` (a
    transformers ``rope_parameters`` / ``rope_scaling`` dict; None or type ``default``: none)."""
    inv = _base_inv_freq(base, head_dim)
    if freq_factors:
        if len(freq_factors) != head_dim // 2:
            raise ValueError(f"rope_freqs has {len(freq_factors)} factors, head_dim {head_dim} needs {head_dim // 2}")
        inv = inv / torch.tensor(freq_factors, dtype=torch.float64)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in ("default", "dynamic"):
        return inv
    s = scaling
    factor = float(s["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        old = float(s["original_max_position_embeddings"])
        low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return torch.where(medium, smoothed, out)
    if kind == "yarn":
        orig = float(s["original_max_position_embeddings"])
        beta_fast = float(s.get("beta_fast") or 32)
        beta_slow = float(s.get("beta_slow") or 1)
        dim = head_dim

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if s.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
        extrapolation = 1 - ramp
        return (inv / factor) * (1 - extrapolation) + inv * extrapolation
    raise ValueError(f"rope type {kind!r} is not implemented (supported: {', '.join(ROPE_TYPES)})")


def attention_factor(scaling: Mapping | None) -> float:
    """The factor transformers multiplies cos and sin by (yarn's ``mscale``; 1 elsewhere)."""
    s = scaling or {}
    if s.get("rope_type", s.get("type")) != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(factor, float(s["mscale"])) / mscale(factor, float(s["mscale_all_dim"]))
    return mscale(factor)


def rope_cos_sin(base: float, head_dim: int, positions: torch.Tensor, *, device=None,
                 inv: torch.Tensor | None = None, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[len(positions), head_dim]`` in float32 (Hugging Face ``rotate_half`` layout),
    computed in float64. ``inv``: the inverse frequencies (default: unscaled rope of ``base``);
    ``scale``: a factor on cos and sin (yarn's attention factor)."""
    if inv is None:
        inv = inv_freq(base, head_dim)
    freqs = torch.outer(positions.detach().to("cpu", torch.float64), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).float().to(device), (emb.sin() * scale).float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [H, T, D]; cos/sin: [T, D]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin
