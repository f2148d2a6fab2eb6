"""Linear layers over GGUF-quantized weights, kept quantized (native: ``_cpu.linear_q``).

A GGUF file's projection tensors (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) are
repacked at load, in memory, into the two layouts the native kernel reads (kernels/csrc/qlinear.cpp):

- **U4**: 4-bit ``q`` in [0, 15], blocks of 32 columns, ``w = scale * q + min`` (Q4_0, Q4_1, Q4_K);
- **I8**: 8-bit ``q`` in [-128, 127] (stored as ``q + 128``), blocks of 16 or 32 columns,
  ``w = scale * q (+ min)`` (Q5_0, Q5_1, Q5_K, Q8_0, Q2_K, Q3_K);
- **U4K** (Q4_K) and **U6K** (Q6_K): U4's nibbles (and, for Q6_K, a plane of the high 2 bits),
  the scale and min kept as the file keeps them: a float32 per 256-column super-block times a
  byte per block (0.59 and 0.83 bytes per weight, against the file's 0.56 and 0.82).

``scale`` and ``min`` are the float32 products of the block's fields that the ``gguf`` package's
reference dequantizer forms, so ``scale * q + min`` is that dequantizer's value bit for bit
(``QuantLinear.dequantize``; tested per type). F32, F16 and BF16 projections become bfloat16
``PackedLinear`` parts. Other types (the IQ* family, TQ*) are refused by name.

``QuantLinear(x)`` quantizes each row of ``x`` on its own (int8 per 32 columns, per 256 for Q4_K and
Q6_K), so a row's result depends on that row alone, at every ISA level the same bits (see
qlinear.cpp for the arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .cpu_attention import _cpu, available

__all__ = ["QUANT_TYPES", "QuantLinear", "QuantPart", "UnsupportedQuantType", "body", "linear_q_supported",
           "repack", "unpack"]

FMT_U4, FMT_I8, FMT_U4K, FMT_U6K = 0, 1, 2, 3
QK_K = 256


class UnsupportedQuantType(ValueError):
    """A GGUF tensor type this kernel has no repacking for (named in the message)."""


def linear_q_supported() -> bool:
    """Whether the native quantized linear is built here (CPU)."""
    return available() and hasattr(_cpu, "linear_q")


def body() -> str:
    """The quantized linears' body at the ISA level set now ("amx-int8", "avx512vnni", "avx2", "neon",
    "scalar"; "amx-int8" is the VNNI body with prompt chunks of Q6_K weights on AMX tiles)."""
    return _cpu.qlinear_body() if linear_q_supported() else "none"


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


# Per type: raw blocks [n, type_size] uint8 -> (q [n, block] int16, scale [n, sub] f32, min or None,
# fmt, B). The arithmetic mirrors gguf.quants' dequantize_blocks step for step.
def _q4_0(b):
    n = b.shape[0]
    d = _f16(b[:, :2])
    qs = b[:, 2:].reshape(n, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)
    q = (qs & 0x0F).reshape(n, 32).astype(np.int16)
    return q, d, -8 * d, FMT_U4, 32          # d * (q - 8) == d * q + (-8 d), both exact


def _q4_1(b):
    n = b.shape[0]
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    qs = b[:, 4:].reshape(n, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)
    return (qs & 0x0F).reshape(n, 32).astype(np.int16), d, m, FMT_U4, 32


def _q5(b, has_min: bool):
    n = b.shape[0]
    o = 4 if has_min else 2
    d = _f16(b[:, :2])
    qh = np.ascontiguousarray(b[:, o:o + 4]).view(np.uint32).reshape(n, 1) >> np.arange(32, dtype=np.uint32)
    ql = b[:, o + 4:].reshape(n, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)
    q = ((ql & 0x0F).reshape(n, 32) | ((qh & 1).astype(np.uint8) << 4)).astype(np.int16)
    if has_min:
        return q, d, _f16(b[:, 2:4]), FMT_I8, 32
    return q - 16, d, None, FMT_I8, 32


def _q8_0(b):
    return b[:, 2:].view(np.int8).astype(np.int16), _f16(b[:, :2]), None, FMT_I8, 32


def _q2_k(b):
    n = b.shape[0]
    scales, qs, d, dmin = b[:, :16], b[:, 16:80], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = d * (scales & 0xF).astype(np.float32)
    ml = dmin * (scales >> 4).astype(np.float32)
    q = (qs.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    return q.reshape(n, QK_K).astype(np.int16), dl, -ml, FMT_I8, 16


def _q3_k(b):
    n = b.shape[0]
    hmask, qs, scales, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    ls = (scales[:, :8].reshape(n, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    hs = (scales[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)).reshape(n, 16)
    sc = ((ls & 0x0F) | ((hs & 0x03) << 4)).astype(np.int8) - np.int8(32)
    dl = d * sc.astype(np.float32)
    ql = (qs.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)).reshape(n, 16, 16) & 3
    qh = (hmask.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)).reshape(n, 16, 16) & 1
    q = ql.astype(np.int16) - ((qh ^ 1).astype(np.int16) << 2)
    return q.reshape(n, QK_K), dl, None, FMT_I8, 16


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    q = (b[:, 16:].reshape(n, -1, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    return q.reshape(n, QK_K).astype(np.int16), d * sc, -(dmin * mn), FMT_U4, 32


def _q5_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qh, qs = b[:, 16:48], b[:, 48:]
    ql = (qs.reshape(n, -1, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)).reshape(n, 8, 32) & 0x0F
    qh = (qh.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)).reshape(n, 8, 32) & 1
    q = (ql | (qh << 4)).reshape(n, QK_K).astype(np.int16)
    return q, d * sc, -(dmin * mn), FMT_I8, 32


def _q6_k(b):
    n = b.shape[0]
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    dl = d * scales.view(np.int8).astype(np.float32)
    ql = (ql.reshape(n, -1, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)).reshape(n, -1, 32) & 0x0F
    qh = (qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)).reshape(n, -1, 32) & 3
    q = (ql | (qh << 4)).astype(np.int16) - 32
    return q.reshape(n, QK_K), dl, None, FMT_I8, 16


# GGUF type name -> (block columns, block bytes, unpacker)
_UNPACK = {"Q4_0": (32, 18, _q4_0), "Q4_1": (32, 20, _q4_1), "Q5_0": (32, 22, lambda b: _q5(b, False)),
           "Q5_1": (32, 24, lambda b: _q5(b, True)), "Q8_0": (32, 34, _q8_0), "Q2_K": (256, 84, _q2_k),
           "Q3_K": (256, 110, _q3_k), "Q4_K": (256, 144, _q4_k), "Q5_K": (256, 176, _q5_k),
           "Q6_K": (256, 210, _q6_k)}
QUANT_TYPES = tuple(_UNPACK)
DENSE_TYPES = ("F32", "F16", "BF16")


def unpack(raw: np.ndarray, qtype: str, K: int):
    """A quantized tensor's raw rows ``[N, K / block * block_bytes]`` uint8 -> ``(q [N, K] int16,
    scale [N, K / B] float32, min [N, K / B] float32 or None, fmt, B)`` with ``scale * q + min``
    equal to the gguf dequantizer's value."""
    if qtype not in _UNPACK:
        raise UnsupportedQuantType(f"GGUF tensor type {qtype} is not supported by the quantized linears "
                                   f"(supported: {', '.join(QUANT_TYPES + DENSE_TYPES)})")
    bs, ts, fn = _UNPACK[qtype]
    if K % bs:
        raise ValueError(f"a {qtype} row of {K} columns is not whole blocks of {bs}")
    N = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(N * (K // bs), ts)
    q, scale, mn, fmt, B = fn(blocks)
    q = q.reshape(N, K)
    scale = np.ascontiguousarray(scale, dtype=np.float32).reshape(N, K // B)
    mn = None if mn is None else np.ascontiguousarray(mn, dtype=np.float32).reshape(N, K // B)
    return q, scale, mn, fmt, B


@dataclass
class QuantPart:
    """One repacked row range of a ``QuantLinear`` (see qlinear.cpp for the layout)."""

    qtype: str
    fmt: int
    B: int
    N: int
    K: int
    q: torch.Tensor               # uint8 [ceil(N/16), K/B, bytes per block of 16 rows]
    scale: torch.Tensor           # float32 [ceil(N/16), K/B, 16]; U4K / U6K: [ceil(N/16), K/256, 16] (d)
    mins: torch.Tensor | None     # float32 as scale, or None; U4K: -dmin per super-block
    sub: torch.Tensor | None = None       # U4K: uint8 sc [ceil(N/16), K/B, 16]; U6K: int8 sc as uint8
    sub_mins: torch.Tensor | None = None  # U4K: uint8 m

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.mins, self.sub, self.sub_mins)
                   if t is not None)


def _lanes(a: np.ndarray, NP: int) -> torch.Tensor:
    """[N, n] per-row values (N padded to 16 NP rows) -> [NP, n, 16]."""
    n = a.shape[1]
    return torch.from_numpy(np.ascontiguousarray(a.reshape(NP, 16, n).transpose(0, 2, 1)))


def _nibbles(q: np.ndarray, NP: int, nb: int) -> np.ndarray:
    """[16 NP, K] values < 16 -> U4's steps [NP, nb, K/nb/8, 16, 4] (byte i: weight i | weight i + 4 << 4)."""
    B = q.shape[1] // nb
    u = q.astype(np.uint8).reshape(NP, 16, nb, B // 8, 2, 4)
    return (u[..., 0, :] | (u[..., 1, :] << 4)).transpose(0, 2, 3, 1, 4)


def _pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    return a if a.shape[0] == rows else np.concatenate([a, np.zeros((rows - a.shape[0],) + a.shape[1:], a.dtype)])


def _repack_k(raw: np.ndarray, qtype: str, K: int, *, native: bool | None = None) -> QuantPart:
    """Q4_K -> U4K, Q6_K -> U6K: the file's super-block scales and block bytes kept as they are.
    ``native`` (default: where the extension is built): ``_cpu.repack_k``, the same bytes as the
    numpy code below (the reference the tests hold it to), several times faster at load."""
    if native is None:
        native = available() and hasattr(_cpu, "repack_k")
    if native:
        return _repack_k_native(raw, qtype, K)
    N = raw.shape[0]
    NP = -(-N // 16)
    b = _pad_rows(np.ascontiguousarray(raw), NP * 16).reshape(NP * 16 * (K // QK_K), -1)
    ns = K // QK_K
    if qtype == "Q4_K":
        q, _, _, _, _ = _q4_k(b)
        d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
        sc, mn = _k_scale_min(b[:, 4:16])
        nb = K // 32
        packed = _nibbles(q.reshape(NP * 16, K), NP, nb).reshape(NP, nb, 256)
        return QuantPart(qtype=qtype, fmt=FMT_U4K, B=32, N=N, K=K, q=torch.from_numpy(np.ascontiguousarray(packed)),
                         scale=_lanes(d.reshape(NP * 16, ns), NP), mins=_lanes(-dmin.reshape(NP * 16, ns), NP),
                         sub=_lanes(sc.astype(np.uint8).reshape(NP * 16, nb), NP),
                         sub_mins=_lanes(mn.astype(np.uint8).reshape(NP * 16, nb), NP))
    q, _, _, _, _ = _q6_k(b)
    u = (q + 32).astype(np.uint8).reshape(NP * 16, K)           # [0, 63]
    nb = K // 16
    lo = _nibbles(u & 0x0F, NP, nb).reshape(NP, nb, 128)
    # the high 2 bits: lane r, byte i, bits 2k..2k+1 (k = 2 step + half) of weight 8 step + 4 half + i
    hb = (u >> 4).reshape(NP, 16, nb, 2, 2, 4)                   # [.., step, half, i]
    plane = np.zeros((NP, 16, nb, 4), np.uint8)
    for st in range(2):
        for h in range(2):
            plane |= hb[:, :, :, st, h, :] << np.uint8(2 * (2 * st + h))
    plane = plane.transpose(0, 2, 1, 3).reshape(NP, nb, 64)
    packed = np.concatenate([lo, plane], axis=2)
    d = _f16(b[:, 208:210])
    sc = b[:, 192:208].view(np.int8)
    return QuantPart(qtype=qtype, fmt=FMT_U6K, B=16, N=N, K=K, q=torch.from_numpy(np.ascontiguousarray(packed)),
                     scale=_lanes(d.reshape(NP * 16, ns), NP), mins=None,
                     sub=_lanes(sc.view(np.uint8).reshape(NP * 16, nb), NP))


def _repack_k_native(raw: np.ndarray, qtype: str, K: int) -> QuantPart:
    N = raw.shape[0]
    if raw.ndim != 2 or raw.dtype != np.uint8 or raw.strides[1] != 1:
        raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(N, -1)
    NP, ns = -(-N // 16), K // QK_K
    four = qtype == "Q4_K"
    nb = K // 32 if four else K // 16
    q = torch.empty((NP, nb, 256 if four else 192), dtype=torch.uint8)
    scale = torch.empty((NP, ns, 16), dtype=torch.float32)
    mins = torch.empty((NP, ns, 16), dtype=torch.float32) if four else None
    sub = torch.empty((NP, nb, 16), dtype=torch.uint8)
    sub_mins = torch.empty((NP, nb, 16), dtype=torch.uint8) if four else None
    _cpu.repack_k(raw.ctypes.data, raw.strides[0], N, K, 4 if four else 6, q.data_ptr(), scale.data_ptr(),
                  0 if mins is None else mins.data_ptr(), sub.data_ptr(), 0 if sub_mins is None else sub_mins.data_ptr(),
                  1)
    return QuantPart(qtype=qtype, fmt=FMT_U4K if four else FMT_U6K, B=32 if four else 16, N=N, K=K, q=q, scale=scale,
                     mins=mins, sub=sub, sub_mins=sub_mins)


REPACK_ROWS = 4096   # rows repacked at a time: bounds the temporaries (a 151,936-row head: ~20x less)


def repack(raw: np.ndarray, qtype: str, K: int) -> QuantPart:
    """Raw GGUF rows of ``qtype`` -> a ``QuantPart`` (a new, contiguous copy; ``raw`` may be a
    memory map and is not kept). Large tensors go ``REPACK_ROWS`` rows at a time into the
    preallocated result (panels are independent), so the unpacking's temporaries stay small."""
    N = raw.shape[0]
    if N <= REPACK_ROWS:
        return _repack_rows(raw, qtype, K)
    first = _repack_rows(raw[:REPACK_ROWS], qtype, K)
    NP, P0 = -(-N // 16), REPACK_ROWS // 16

    def full(t):
        if t is None:
            return None
        out = torch.empty((NP,) + tuple(t.shape[1:]), dtype=t.dtype)
        out[:P0] = t
        return out

    part = QuantPart(qtype=qtype, fmt=first.fmt, B=first.B, N=N, K=K, q=full(first.q), scale=full(first.scale),
                     mins=full(first.mins), sub=full(first.sub), sub_mins=full(first.sub_mins))
    del first
    for r0 in range(REPACK_ROWS, N, REPACK_ROWS):
        chunk = _repack_rows(raw[r0:r0 + REPACK_ROWS], qtype, K)
        p0 = r0 // 16
        p1 = p0 + chunk.q.shape[0]
        for name in ("q", "scale", "mins", "sub", "sub_mins"):
            t = getattr(chunk, name)
            if t is not None:
                getattr(part, name)[p0:p1] = t
    return part


def _repack_rows(raw: np.ndarray, qtype: str, K: int) -> QuantPart:
    if qtype in ("Q4_K", "Q6_K") and K % QK_K == 0:
        return _repack_k(raw, qtype, K)
    q, scale, mn, fmt, B = unpack(raw, qtype, K)
    N = q.shape[0]
    NP = -(-N // 16)
    nb = K // B
    q, scale = _pad_rows(q, NP * 16), _pad_rows(scale, NP * 16)
    if fmt == FMT_U4:
        packed = _nibbles(q, NP, nb)                                                 # [NP, nb, steps, 16, 4]
    else:
        packed = (q + 128).astype(np.uint8).reshape(NP, 16, nb, B // 4, 4).transpose(0, 2, 3, 1, 4)
    return QuantPart(qtype=qtype, fmt=fmt, B=B, N=N, K=K, q=torch.from_numpy(np.ascontiguousarray(packed)),
                     scale=_lanes(scale, NP), mins=None if mn is None else _lanes(_pad_rows(mn, NP * 16), NP))


def _dequantize_part(p: QuantPart, rows: np.ndarray | None = None) -> np.ndarray:
    """``scale * q + min`` float32 ``[len(rows), K]`` (default: every row) from a part's packed
    arrays: the gguf dequantizer's values, bit for bit."""
    rows = np.arange(p.N) if rows is None else np.asarray(rows, dtype=np.int64)
    pi, li = rows // 16, rows % 16
    T, nb = rows.shape[0], p.K // p.B
    raw = p.q.numpy().reshape(p.q.shape[0], nb, -1)

    def lanes(t: torch.Tensor) -> np.ndarray:          # [NP, n, 16] -> [T, n]
        return t.numpy()[pi, :, li]

    if p.fmt == FMT_I8:
        q = (raw.reshape(-1, nb, p.B // 4, 16, 4)[pi, :, :, li, :].astype(np.int16) - 128).reshape(T, p.K)
    else:
        steps = p.B // 8
        nib = raw[:, :, :64 * steps].reshape(-1, nb, steps, 16, 4)[pi, :, :, li, :]   # [T, nb, steps, 4]
        q = np.stack([nib & 0x0F, nib >> 4], axis=3).reshape(T, p.K).astype(np.int16)
        if p.fmt == FMT_U6K:
            plane = raw[:, :, 64 * steps:].reshape(-1, nb, 16, 4)[pi, :, li, :]            # [T, nb, 4]
            hi = np.stack([(plane >> np.uint8(2 * k)) & 3 for k in range(4)], axis=2)     # [T, nb, k, 4]
            q = (q | (hi.reshape(T, p.K).astype(np.int16) << 4)) - 32
    if p.fmt in (FMT_U4K, FMT_U6K):
        per = QK_K // p.B                                   # blocks per super-block
        sub = lanes(p.sub).view(np.int8 if p.fmt == FMT_U6K else np.uint8).astype(np.float32)
        scale = np.repeat(lanes(p.scale), per, axis=1) * sub
        mins = None if p.fmt == FMT_U6K else np.repeat(lanes(p.mins), per, axis=1) * lanes(p.sub_mins).astype(np.float32)
    else:
        scale, mins = lanes(p.scale), None if p.mins is None else lanes(p.mins)
    w = q.astype(np.float32).reshape(T, nb, p.B) * scale[:, :, None]
    if mins is not None:
        w = w + mins[:, :, None]
    return w.reshape(T, p.K)


class QuantLinear:
    """``y = x @ W.T`` (no bias) for bfloat16 rows ``x [M, K]`` -> ``[M, N]`` bfloat16, ``W`` kept
    quantized: row ranges (``parts``: a fused q/k/v or gate/up projection whose parts have
    different GGUF types) each repacked (``QuantPart``) or, for F32/F16/BF16, a bfloat16
    ``PackedLinear``."""

    __slots__ = ("N", "K", "parts", "tensor_types")

    def __init__(self, parts: list, tensor_types: list[str] | None = None):
        if not parts:
            raise ValueError("a QuantLinear needs at least one part")
        self.K = parts[0].K
        if any(p.K != self.K for p in parts):
            raise ValueError("every part of a QuantLinear must have the same input width")
        self.parts = list(parts)
        self.N = sum(p.N for p in self.parts)
        # the type each source tensor runs as (its GGUF type; BF16 for float ones), in order:
        # neighbouring tensors of one type are one part
        self.tensor_types = list(tensor_types) if tensor_types is not None else [p.qtype for p in self.parts]

    @classmethod
    def from_raw(cls, tensors: list[tuple[str, np.ndarray, int]]) -> QuantLinear:
        """``[(gguf_type_name, raw rows or dense [N, K] array, K), ...]`` -> one ``QuantLinear``
        whose output rows are the tensors' rows in order. Neighbours of one quantized type (a
        fused q/k, gate/up) are repacked as one part: one kernel call, one activation
        quantization per forward (a row's bits do not depend on which rows share its panel)."""
        from .cpu_linear import PackedLinear

        groups: list[tuple[str, list[np.ndarray], int]] = []
        for qtype, arr, K in tensors:
            if groups and qtype not in DENSE_TYPES and groups[-1][0] == qtype and groups[-1][2] == K:
                groups[-1][1].append(arr)
            else:
                groups.append((qtype, [arr], K))
        parts = []
        for qtype, arrs, K in groups:
            if qtype in DENSE_TYPES:
                w = torch.from_numpy(np.ascontiguousarray(arrs[0], dtype=np.float32)).to(torch.bfloat16)
                parts.append(_DensePart(PackedLinear(w)))
            else:
                parts.append(repack(arrs[0] if len(arrs) == 1 else np.concatenate(arrs), qtype, K))
        return cls(parts, ["BF16" if qtype in DENSE_TYPES else qtype for qtype, _, _ in tensors])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def types(self) -> list[str]:
        """The type each tensor this projection was made of runs as, in order."""
        return self.tensor_types

    def dequantize(self) -> torch.Tensor:
        """The ``[N, K]`` float32 weight the kernel multiplies with (``scale * q + min``)."""
        return torch.cat([torch.from_numpy(_dequantize_part(p)) if isinstance(p, QuantPart) else p.lin.weight().float()
                          for p in self.parts])

    def weight(self) -> torch.Tensor:
        """The weight as bfloat16 ``[N, K]`` (tools and torch-path fallbacks; not the kernel's bits)."""
        return self.dequantize().to(torch.bfloat16)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight, float32 ``[len(ids), K]`` (an embedding lookup: the same
        values as ``dequantize()[ids]``, without dequantizing the rest)."""
        ids = ids.reshape(-1).to(torch.int64).numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= self.N):
            raise IndexError(f"row ids must be in [0, {self.N})")
        out = np.empty((ids.size, self.K), np.float32)
        off = 0
        for p in self.parts:
            sel = (ids >= off) & (ids < off + p.N)
            if sel.any():
                if isinstance(p, QuantPart):
                    out[sel] = _dequantize_part(p, ids[sel] - off)
                else:
                    out[sel] = p.lin.weight()[torch.from_numpy(ids[sel] - off)].float().numpy()
            off += p.N
        return torch.from_numpy(out)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None, *, threads: int = 0,
                 norm: tuple[torch.Tensor, float] | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``x @ W.T``. ``norm=(weight, eps)``: of ``rms_norm(x) * weight`` instead, the norm fused
        into the activation quantization (rounded to bfloat16 per value: qlinear.cpp's
        ACT_RMSNORM; not torch's bits, and no torch call). Each row's result depends on that row
        alone. ``dtype`` (or ``out``'s): bfloat16, or float32 for the accumulators unrounded (an
        output head: logits without bfloat16's ties; rounded to bfloat16 they are the bfloat16
        output's bits)."""
        if x.dim() != 2 or x.shape[1] != self.K or x.dtype != torch.bfloat16 or x.device.type != "cpu":
            raise ValueError(f"x must be bfloat16 [M, {self.K}], got {tuple(x.shape)} {x.dtype}")
        if x.stride(1) != 1:
            x = x.contiguous()
        act, nw, eps = 0, 0, 0.0
        if norm is not None:
            w, eps = norm
            if w.dtype != torch.bfloat16 or w.shape != (self.K,):
                raise ValueError(f"the norm weight must be bfloat16 [{self.K}], got {tuple(w.shape)} {w.dtype}")
            w = w.contiguous()
            act, nw = 1, w.data_ptr()
        M = x.shape[0]
        if out is None:
            out = torch.empty(M, self.N, dtype=dtype)
        if out.dtype not in (torch.bfloat16, torch.float32) or out.shape != (M, self.N) or out.stride(1) != 1:
            raise ValueError(f"out must be bfloat16 or float32 [{M}, {self.N}] with unit column stride, got "
                             f"{tuple(out.shape)} {out.dtype}")
        f32 = out.dtype == torch.float32
        if M == 0:
            return out
        off = 0
        dense_x = None
        for p in self.parts:
            if isinstance(p, QuantPart):
                _cpu.linear_q(x.data_ptr(), x.stride(0), M, p.q.data_ptr(), p.scale.data_ptr(),
                              0 if p.mins is None else p.mins.data_ptr(), 0 if p.sub is None else p.sub.data_ptr(),
                              0 if p.sub_mins is None else p.sub_mins.data_ptr(), p.fmt, p.B, p.N, p.K,
                              out.data_ptr() + out.element_size() * off, out.stride(0), threads, act, nw, float(eps),
                              f32)
            else:
                if dense_x is None:
                    dense_x = _act_reference(x, act, norm)
                if f32:   # the bfloat16 linear's output, widened (exact)
                    out[:, off:off + p.N] = p.lin(dense_x, torch.empty(M, p.N, dtype=torch.bfloat16))
                else:
                    p.lin(dense_x, out[:, off:off + p.N])
            off += p.N
        return out


def _act_reference(x: torch.Tensor, act: int, norm) -> torch.Tensor:
    """qlinear.cpp's ACT_RMSNORM in torch (an F32 / F16 / BF16 part of a QuantLinear)."""
    if act == 0:
        return x
    xf = x.float()
    w, eps = norm
    r = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * r * w.float()).to(torch.bfloat16)


class _DensePart:
    """An F32 / F16 / BF16 row range of a ``QuantLinear``: a bfloat16 ``PackedLinear``."""

    __slots__ = ("lin", "qtype")

    def __init__(self, lin):
        self.lin = lin
        self.qtype = "BF16"

    @property
    def N(self) -> int:
        return self.lin.N

    @property
    def K(self) -> int:
        return self.lin.K

    @property
    def nbytes(self) -> int:
        return self.lin.packed.numel() * 2
