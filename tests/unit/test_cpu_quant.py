"""The quantized linears (agentspec.kernels.cpu_quant, kernels/csrc/qlinear.cpp) on random GGUF
blocks of every supported type: the repacked weight is the gguf package's dequantization; every
ISA level gives the plain reference's bits; a row's result does not depend on the other rows or
the thread count; the arithmetic is the documented one (an independent numpy implementation);
and the product stays close to the dequantized float product."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agentspec.kernels import cpu_isa, cpu_quant

from helpers.families import random_quantized

pytestmark = pytest.mark.skipif(not cpu_quant.linear_q_supported(), reason="the native extension is not built")

TYPES = cpu_quant.QUANT_TYPES
# float16 fields of the types random_quantized does not know (offsets in a block)
_F16 = {"Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,)}


def _raw(qtype: str, N: int, K: int, seed: int = 0) -> np.ndarray:
    import gguf

    rng = np.random.default_rng(seed)
    if qtype not in _F16:
        return random_quantized(N, K, qtype, rng)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, size=(N, K // block, size), dtype=np.uint8)
    for off in _F16[qtype]:
        raw[:, :, off:off + 2] = rng.uniform(0.5e-4, 2e-4, size=(N, K // block)).astype(np.float16).view(
            np.uint8).reshape(N, K // block, 2)
    return raw.reshape(N, -1)


def _dequant(raw, qtype, N, K) -> np.ndarray:
    import gguf
    from gguf.quants import dequantize

    return np.asarray(dequantize(raw, gguf.GGMLQuantizationType[qtype]), np.float32).reshape(N, K)


@pytest.mark.parametrize("qtype", TYPES)
def test_repacked_weight_is_the_gguf_dequantization(qtype):
    N, K = 40, 512   # 40 rows: a partial last panel of 16
    raw = _raw(qtype, N, K)
    lin = cpu_quant.QuantLinear.from_raw([(qtype, raw, K)])
    assert (lin.N, lin.K, lin.types()) == (N, K, [qtype])
    ours = lin.dequantize().numpy()
    ref = _dequant(raw, qtype, N, K)
    assert np.array_equal(ours, ref)   # values (Q4_0's zero may carry the other sign)


@pytest.mark.parametrize("qtype", TYPES)
def test_every_isa_level_gives_the_references_bits_row_by_row(qtype, restore_isa):
    N, K, M = 40, 512, 7
    lin = cpu_quant.QuantLinear.from_raw([(qtype, _raw(qtype, N, K, seed=1), K)])
    x = (torch.randn(M, K, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16)
    restore_isa.set_isa("scalar")
    assert cpu_quant.body() == "scalar"
    ref = lin(x)
    for isa in restore_isa.supported():
        restore_isa.set_isa(isa)
        got = lin(x)
        assert torch.equal(got, ref), (isa, cpu_quant.body())
        # each row alone, and one thread: the same bits
        assert torch.equal(torch.cat([lin(x[i:i + 1]) for i in range(M)]), ref), isa
        assert torch.equal(lin(x, threads=1), ref), isa
        # every tile height a body has (1 to 7 rows: one tile each on the 8-row bodies)
        for rows in range(1, M):
            assert torch.equal(lin(x[:rows]), ref[:rows]), (isa, rows)
        # a prompt chunk (more rows than one pass over the weight takes): each row the same bits
        big = torch.cat([x] * 11)
        assert torch.equal(lin(big), torch.cat([ref] * 11)), isa


def _quantize_rows(xf: np.ndarray, G: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of x -> (int8 values [M, K], scales [M, K / G]): per G columns d = amax / 127,
    q = round-half-even(x / d) clipped to [-127, 127] (0 where d is 0)."""
    f32 = np.float32
    M, K = xf.shape
    blocks = xf.reshape(M, K // G, G)
    d = (np.abs(blocks).max(axis=2) / f32(127)).astype(f32)
    inv = np.where(d != 0, f32(1) / np.where(d != 0, d, f32(1)), f32(0)).astype(f32)
    xq = np.clip(np.rint((blocks * inv[:, :, None]).astype(f32)), -127, 127).astype(np.int64).reshape(M, K)
    return xq, d


def _reference(raw: np.ndarray, qtype: str, x: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The documented arithmetic (qlinear.cpp's header) in numpy float32, one operation at a time,
    from the unpacked blocks (``cpu_quant.unpack``: q, scale, min; for Q4_K / Q6_K the file's own
    super-block scales and integer sub-scales); rounded to ``dtype``."""
    f32 = np.float32
    xf = x.float().numpy()
    M, K = xf.shape
    q, scale, mins, fmt, B = cpu_quant.unpack(raw, qtype, K)
    acc = np.zeros((M, q.shape[0]), f32)
    if qtype in ("Q4_K", "Q6_K"):   # activations per 256 columns; the blocks combined in integers
        xq, d = _quantize_rows(xf, 256)
        N, ns = q.shape[0], K // 256
        blk = raw.reshape(N, ns, -1)
        if qtype == "Q4_K":
            sd = blk[:, :, 0:2].copy().view(np.float16)[..., 0].astype(f32)
            dmin = blk[:, :, 2:4].copy().view(np.float16)[..., 0].astype(f32)
            sc, mn = (a.astype(np.int64).reshape(N, ns, 8) for a in cpu_quant._k_scale_min(blk[:, :, 4:16].reshape(-1, 12)))
        else:
            sd = blk[:, :, 208:210].copy().view(np.float16)[..., 0].astype(f32)
            sc = blk[:, :, 192:208].view(np.int8).astype(np.int64)
        per = 256 // B
        for s in range(ns):
            v = np.zeros((M, N), np.int64)
            mv = np.zeros((M, N), np.int64)
            for jj in range(per):
                c = (s * per + jj) * B
                isum = xq[:, c:c + B] @ q[:, c:c + B].astype(np.int64).T
                v += isum * sc[None, :, s, jj]
                if qtype == "Q4_K":
                    mv += xq[:, c:c + B].sum(axis=1)[:, None] * mn[None, :, s, jj]
            acc = (acc + (sd[None, :, s] * (v.astype(f32) * d[:, s][:, None]).astype(f32)).astype(f32)).astype(f32)
            if qtype == "Q4_K":
                acc = (acc + (-dmin[None, :, s] * (mv.astype(f32) * d[:, s][:, None]).astype(f32)).astype(f32)).astype(f32)
        return torch.from_numpy(acc).to(dtype)
    xq, d = _quantize_rows(xf, 32)
    for j in range(K // B):
        isum = xq[:, j * B:(j + 1) * B] @ q[:, j * B:(j + 1) * B].astype(np.int64).T     # [M, N] exact
        t = (isum.astype(f32) * d[:, (j * B) // 32][:, None]).astype(f32)
        acc = (acc + (scale[None, :, j] * t).astype(f32)).astype(f32)
        if mins is not None:
            xs = xq[:, j * B:(j + 1) * B].sum(axis=1)
            xsf = (d[:, (j * B) // 32] * xs.astype(f32)).astype(f32)
            acc = (acc + (mins[None, :, j] * xsf[:, None]).astype(f32)).astype(f32)
    return torch.from_numpy(acc).to(dtype)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_1", "Q8_0"])   # U4 + min, I8 B16, I8 + min, I8 B32
def test_the_arithmetic_is_the_documented_one(qtype):
    N, K = 24, 512
    raw = _raw(qtype, N, K, seed=3)
    lin = cpu_quant.QuantLinear.from_raw([(qtype, raw, K)])
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    x[1, :32] = 0   # an all-zero block: its scale is 0
    assert torch.equal(lin(x), _reference(raw, qtype, x))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
def test_float32_outputs_are_the_unrounded_accumulators_at_every_isa_level(qtype, restore_isa):
    """An output head's logits come out as float32 (``dtype=torch.float32``): the documented
    arithmetic's float32 accumulators themselves, at every ISA level and row by row, and rounded
    to bfloat16 the bfloat16 output's bits."""
    N, K, M = 40, 512, 9   # 9 rows: an 8-row tile and a 1-row one
    raw = _raw(qtype, N, K, seed=5)
    lin = cpu_quant.QuantLinear.from_raw([(qtype, raw, K)])
    x = (torch.randn(M, K, generator=torch.Generator().manual_seed(6)) * 2).to(torch.bfloat16)
    ref = _reference(raw, qtype, x, torch.float32)
    assert not torch.equal(ref, ref.to(torch.bfloat16).float())   # float32 carries more than bfloat16
    for isa in ["scalar", *restore_isa.supported()]:
        restore_isa.set_isa(isa)
        got = lin(x, dtype=torch.float32)
        assert got.dtype == torch.float32 and torch.equal(got, ref), (isa, cpu_quant.body())
        assert torch.equal(torch.cat([lin(x[i:i + 1], dtype=torch.float32) for i in range(M)]), ref), isa
        assert torch.equal(got.to(torch.bfloat16), lin(x)), isa
    out = torch.empty(M, N, dtype=torch.float16)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        lin(x, out)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_prompt_chunks_on_amx_tiles_are_the_documented_arithmetic(qtype):
    """On a CPU with AMX-INT8, prompt chunks (64 rows or more) of Q6_K weights run on tiles, a
    super-block a product (Q4_K's on the VNNI body under the same name): every row the documented
    arithmetic's bits (bfloat16 and float32 outputs), in a chunk or alone, on one thread or two,
    whatever the chunk's length."""
    if cpu_quant.body() != "amx-int8":   # (a run capped with AGENTSPEC_CPU_ISA stays capped)
        pytest.skip(f"no AMX-INT8 body at this level (the body is {cpu_quant.body()})")
    N, K, M = 72, 1024, 100   # 4 super-blocks a row; 6 tiles (3 pairs) and 4 rows past them
    raw = _raw(qtype, N, K, seed=9)
    lin = cpu_quant.QuantLinear.from_raw([(qtype, raw, K)])
    x = (torch.randn(M, K, generator=torch.Generator().manual_seed(10)) * 2).to(torch.bfloat16)
    x[3, :256] = 0   # a super-block of zeros: its activation scale is 0
    ref = _reference(raw, qtype, x, torch.float32)
    got = lin(x, dtype=torch.float32)
    assert torch.equal(got, ref)
    assert torch.equal(lin(x), ref.to(torch.bfloat16))
    assert torch.equal(lin(x, threads=1), ref.to(torch.bfloat16))
    for rows in (64, 80, 97):   # tiles in pairs, a tile alone, rows past the last tile
        assert torch.equal(lin(x[:rows], dtype=torch.float32), ref[:rows]), rows
    assert torch.equal(torch.cat([lin(x[i:i + 1], dtype=torch.float32) for i in range(M)]), ref)


@pytest.mark.parametrize("qtype", TYPES)
def test_close_to_the_dequantized_float_product(qtype):
    """int8 activations per 32 columns (scale amax / 127): for Gaussian rows each value is off by
    at most half a step, ~0.3% of the block's amax in RMS, so the product's relative error is
    about 0.5%; per 256 columns (Q4_K, Q6_K) the amax is ~1.6x a 32-column block's, about 0.6-0.75%
    here; 2% is the bound."""
    N, K = 64, 1024
    raw = _raw(qtype, N, K, seed=5)
    lin = cpu_quant.QuantLinear.from_raw([(qtype, raw, K)])
    x = torch.randn(8, K, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    exact = x.double() @ torch.from_numpy(_dequant(raw, qtype, N, K)).double().T
    err = (lin(x).double() - exact).norm() / exact.norm()
    assert err < 0.02, err


def test_parts_of_different_types_fill_their_rows():
    K = 256
    a, b = _raw("Q4_K", 48, K, 7), _raw("Q6_K", 16, K, 8)
    lin = cpu_quant.QuantLinear.from_raw([("Q4_K", a, K), ("Q6_K", b, K), ("F32", np.ones((8, K), np.float32), K)])
    assert (lin.N, lin.types()) == (72, ["Q4_K", "Q6_K", "BF16"])
    x = torch.randn(3, K).to(torch.bfloat16)
    y = lin(x)
    assert torch.equal(y[:, :48], cpu_quant.QuantLinear.from_raw([("Q4_K", a, K)])(x))
    assert torch.equal(y[:, 48:64], cpu_quant.QuantLinear.from_raw([("Q6_K", b, K)])(x))
    torch.testing.assert_close(y[:, 64:].float(), x.float().sum(dim=1, keepdim=True).expand(3, 8), rtol=2e-2, atol=0.2)


def test_unsupported_types_are_refused_by_name():
    with pytest.raises(cpu_quant.UnsupportedQuantType, match="GGUF tensor type IQ2_XXS is not supported"):
        cpu_quant.QuantLinear.from_raw([("IQ2_XXS", np.zeros((16, 66), np.uint8), 256)])
    with pytest.raises(ValueError, match="not whole blocks of 256"):
        cpu_quant.unpack(np.zeros((2, 144), np.uint8), "Q4_K", 128)
    lin = cpu_quant.QuantLinear.from_raw([("Q8_0", _raw("Q8_0", 16, 64), 64)])
    with pytest.raises(ValueError, match=r"x must be bfloat16 \[M, 64\]"):
        lin(torch.zeros(2, 32, dtype=torch.bfloat16))


@pytest.mark.parametrize("qtype", TYPES)
def test_rows_are_the_dequantized_rows(qtype):
    """An embedding lookup (``QuantLinear.rows``) gives the very values of the whole dequantization."""
    N, K = 40, 512
    raw = _raw(qtype, N, K, seed=9)
    lin = cpu_quant.QuantLinear.from_raw([(qtype, raw[:24], K), ("Q8_0", _raw("Q8_0", 16, K, seed=10), K)])
    ids = torch.tensor([0, 39, 17, 23, 24, 5, 5])
    assert torch.equal(lin.rows(ids), lin.dequantize()[ids])
    first = torch.tensor([0, 17, 23])   # rows of the first part
    assert torch.equal(lin.rows(first), torch.from_numpy(_dequant(raw, qtype, N, K))[first])
    with pytest.raises(IndexError, match=r"row ids must be in \[0, 40\)"):
        lin.rows(torch.tensor([40]))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_0", "Q4_1"])
def test_repacking_in_row_chunks_is_the_same(qtype, monkeypatch):
    """Large tensors repack a few thousand rows at a time (bounded temporaries): the same arrays."""
    N, K = 72, 256
    raw = _raw(qtype, N, K, seed=11)
    whole = cpu_quant.repack(raw, qtype, K)
    monkeypatch.setattr(cpu_quant, "REPACK_ROWS", 32)
    chunked = cpu_quant.repack(raw, qtype, K)
    for name in ("q", "scale", "mins", "sub", "sub_mins"):
        a, b = getattr(whole, name), getattr(chunked, name)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("N", [1, 16, 40, 77])
def test_native_repacking_is_the_numpy_reference_byte_for_byte(qtype, N):
    """The load-time repacking of the K-quants (``_cpu.repack_k``) writes the very arrays the numpy
    code does, on random blocks (random sub-scales and values; float16 scales with subnormal, zero
    and negative values among them), partial panels included."""
    K = 768
    raw = _raw(qtype, N, K, seed=N).copy()
    ts = 144 if qtype == "Q4_K" else 210
    blocks = raw.reshape(N, K // 256, ts)
    specials = np.array([0.0, -0.0, 1e-7, -3e-6, 65504.0, -2.5], np.float16).view(np.uint8).reshape(-1, 2)
    for i, off in enumerate((0, 2) if qtype == "Q4_K" else (208,)):
        blocks[:, 0, off:off + 2] = specials[(np.arange(N) + i) % len(specials)]
    native = cpu_quant._repack_k(raw, qtype, K, native=True)
    ref = cpu_quant._repack_k(raw, qtype, K, native=False)
    for name in ("q", "scale", "mins", "sub", "sub_mins"):
        a, b = getattr(native, name), getattr(ref, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float32 else a,
                               b.view(torch.uint8) if b.dtype == torch.float32 else b), name
    # a row range of a larger tensor (a view with the parent's row stride), as repack's chunks are
    wide = np.concatenate([raw, raw], axis=0)[N // 2:N // 2 + N]
    assert torch.equal(cpu_quant._repack_k(wide, qtype, K, native=True).q,
                       cpu_quant._repack_k(np.ascontiguousarray(wide), qtype, K, native=False).q)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
def test_fused_norm_input(qtype, restore_isa):
    """The input's RMSNorm fused into the activation quantization: every ISA level the same bits,
    a row alone the same bits, and close to torch's norm then the linear."""
    import torch.nn.functional as F

    N, K, M = 48, 512, 6
    lin = cpu_quant.QuantLinear.from_raw([(qtype, _raw(qtype, N, K, seed=12), K)])
    g = torch.Generator().manual_seed(13)
    x = (torch.randn(M, K, generator=g) * 4).to(torch.bfloat16)
    w = (torch.rand(K, generator=g) + 0.5).to(torch.bfloat16)
    restore_isa.set_isa("scalar")
    ref = lin(x, norm=(w, 1e-6))
    for isa in restore_isa.supported():
        restore_isa.set_isa(isa)
        assert torch.equal(lin(x, norm=(w, 1e-6)), ref), isa
        assert torch.equal(torch.cat([lin(x[i:i + 1], norm=(w, 1e-6)) for i in range(M)]), ref), isa
    unfused = lin(F.rms_norm(x, (K,), w, 1e-6))
    assert ((ref.double() - unfused.double()).norm() / unfused.double().norm()).item() < 0.02
    with pytest.raises(ValueError, match=r"the norm weight must be bfloat16 \[512\]"):
        lin(x, norm=(w.float(), 1e-6))


def test_neighbours_of_one_type_are_one_part_with_the_same_bits():
    """A fused q/k or gate/up of one GGUF type repacks as one part (one call per forward): each
    row's result is what the tensors give as separate parts."""
    K = 256
    a, b = _raw("Q4_K", 40, K, 14), _raw("Q4_K", 24, K, 15)
    merged = cpu_quant.QuantLinear.from_raw([("Q4_K", a, K), ("Q4_K", b, K)])
    apart = cpu_quant.QuantLinear([cpu_quant.repack(a, "Q4_K", K), cpu_quant.repack(b, "Q4_K", K)])
    assert len(merged.parts) == 1 and merged.types() == ["Q4_K", "Q4_K"] and merged.N == 64
    x = torch.randn(5, K).to(torch.bfloat16)
    assert torch.equal(merged(x), apart(x))


def test_the_x86_bodies_prefetch_their_weights():
    """The quantized bodies prefetch the weights a few blocks ahead (``prefetch_ahead``): as a
    plain inline helper called from the bodies' target regions it once compiled to nothing, with
    no error, and 4-8 decode rows then waited on memory (the 1.5B's linears at 8 rows: 48 against
    39 ms on Zen 4). The built module must hold the instructions."""
    import platform
    import shutil
    import subprocess

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 bodies only")
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump to read the build with")
    from agentspec.kernels import _cpu

    asm = subprocess.run([objdump, "-d", "--no-show-raw-insn", _cpu.__file__], capture_output=True, text=True,
                         check=True).stdout
    assert asm.count("prefetcht0") >= 32
