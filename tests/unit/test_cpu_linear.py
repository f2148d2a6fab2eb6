"""agentspec.kernels.cpu_linear: the native bfloat16 linear for decode / verify rows. Close to a
float64 reference, and row-invariant bit for bit (a row's output does not depend on the other
rows of the call), which is what lets plain decoding run one row and still equal a draft tree."""

from __future__ import annotations

import pytest
import torch

from agentspec.kernels import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.linear_supported(torch.bfloat16, torch.device("cpu")),
                                reason="agentspec.kernels._cpu not built")

# the bundled model's projections (qkv, o, gate|up, down, tied head), and odd sizes
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (37, 10), (16, 2), (65, 130)]


def _data(N, K, M, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(torch.bfloat16)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    return w, x


@pytest.mark.parametrize("N,K", SHAPES)
def test_close_to_float64_reference(N, K):
    w, x = _data(N, K, 23)
    y = cpu_linear.PackedLinear(w)(x)
    assert y.shape == (23, N) and y.dtype == torch.bfloat16
    ref = x.double() @ w.double().T
    # one float32 reduction rounded once to bfloat16: within bf16 rounding of the exact value
    # plus the float32 accumulation error
    tol = ref.abs() * 2 ** -8 + (x.double().abs() @ w.double().abs().T) * K * 2 ** -24
    assert ((y.double() - ref).abs() <= tol).all()


@pytest.mark.parametrize("N,K", [(960, 576), (576, 1536), (37, 10), (300, 576)])
def test_row_invariant_bitwise(N, K):
    """Every row alone, every slice, a shuffled batch and another thread count: the same bits."""
    w, x = _data(N, K, 40, seed=N)
    lin = cpu_linear.PackedLinear(w)
    full = lin(x)
    for i in range(40):
        assert torch.equal(lin(x[i:i + 1])[0], full[i])
    for a, b in [(0, 7), (3, 17), (5, 6), (11, 40)]:
        assert torch.equal(lin(x[a:b]), full[a:b])
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(1))
    assert torch.equal(lin(x[perm]), full[perm])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(lin(x), full)
    finally:
        torch.set_num_threads(threads)


def test_strided_rows_and_out_argument():
    w, x = _data(96, 64, 9)
    lin = cpu_linear.PackedLinear(w)
    wide = torch.zeros(9, 200, dtype=torch.bfloat16)
    wide[:, 10:74] = x
    out = torch.full((9, 120), 7.0, dtype=torch.bfloat16)
    lin(wide[:, 10:74], out=out[:, :96])
    assert torch.equal(out[:, :96], lin(x))
    assert (out[:, 96:] == 7.0).all()  # nothing written past N


@pytest.mark.parametrize("M", [1, 2, 3, 5, 7, 13, 33])
def test_every_isa_level_equals_the_best(M, restore_isa):
    """Each ISA level's kernel (its own tile shapes) gives the best level's bits, for every row
    count (tile remainders) and a column count that is no multiple of the panel groups."""
    cpu_isa = restore_isa
    w, x = _data(300, 576, M, seed=5)
    lin = cpu_linear.PackedLinear(w)
    cpu_isa.set_isa(None)
    ref = lin(x)
    for isa in cpu_isa.supported():
        cpu_isa.set_isa(isa)
        assert torch.equal(lin(x), ref), isa
        for m in range(M):  # and each row alone
            assert torch.equal(lin(x[m:m + 1]), ref[m:m + 1]), (isa, m)


def test_pack_layout():
    w, _ = _data(20, 6, 1)
    p = cpu_linear.pack_weight(w)
    assert p.shape == (2, 3, 16, 2)
    for n in range(20):
        for k in range(6):
            assert p[n // 16, k // 2, n % 16, k % 2] == w[n, k]
    assert (p[1, :, 4:] == 0).all()  # rows past N are zero


def test_bad_input():
    with pytest.raises(ValueError, match="K even"):
        cpu_linear.pack_weight(torch.zeros(4, 5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_linear.pack_weight(torch.zeros(4, 6))
    lin = cpu_linear.PackedLinear(torch.zeros(4, 6, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"x must be bfloat16 \[M, 6\]"):
        lin(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x must be bfloat16"):
        lin(torch.zeros(2, 6))
    with pytest.raises(ValueError, match=r"out must be bfloat16 \[2, 4\]"):
        lin(torch.zeros(2, 6, dtype=torch.bfloat16), out=torch.zeros(2, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be"):
        lin(torch.zeros(2, 6, dtype=torch.bfloat16), out=torch.zeros(4, 2, dtype=torch.bfloat16).t())


def test_model_decode_rows_use_packed_linears(monkeypatch):
    """Dispatch: after pack_linears a bfloat16 model's decode / verify forwards (and segments)
    run every projection and the head natively, and need no padding row; prefill keeps torch's
    GEMM for the projections. A float32 model is not packed. (Here the vector kernels'
    ``__call__``; where AMX runs, decode rows take ``PackedLinear.prefill`` by default:
    test_cpu_attention.py::test_amx_decode_linears_run_and_match_the_vector_ones_closely.)"""
    from agentspec.backends.embedded.model import KVCache, ModelArgs, Transformer
    from agentspec.backends.embedded.model import Segment

    from agentspec.backends.embedded.plan import Settings

    args = ModelArgs(dim=576, n_layers=2, n_heads=9, n_kv_heads=3, hidden_dim=64, vocab_size=50, max_seq_len=256)
    assert not Transformer(args).eval().pack_linears()  # float32
    model = Transformer(args).eval().to(torch.bfloat16)
    model.set_kernel_settings(Settings(decode_linears="vector"))
    cache = KVCache(args, 64, dtype=torch.float32, device=torch.device("cpu"), packed=True)
    assert not model.row_invariant(cache)
    assert model.pack_linears() and model.row_invariant(cache)
    calls = []
    real = cpu_linear.PackedLinear.__call__
    monkeypatch.setattr(cpu_linear.PackedLinear, "__call__", lambda self, x, out=None: calls.append(x.shape[0])
                        or real(self, x, out))
    model(torch.arange(5), torch.arange(5), cache)
    cache.commit(list(range(5)))
    assert calls == [5]  # prefill: torch's GEMM for the projections, the packed head for its few logits rows
    calls.clear()
    model(torch.tensor([1]), torch.tensor([5]), cache, torch.ones(1, 6, dtype=torch.bool))
    assert calls == [1] * (4 * args.n_layers + 1)
    calls.clear()
    model.forward_segments(torch.tensor([1, 2]), torch.tensor([5, 6]),
                           [Segment(cache=cache, rows=2, mask=torch.ones(2, 7, dtype=torch.bool))])
    assert calls == [2] * (4 * args.n_layers + 1)
    unpacked = KVCache(args, 64, dtype=torch.float32, device=torch.device("cpu"))
    assert not model.row_invariant(unpacked)  # torch attention path: rows are padded


def _argmax_cases():
    g = torch.Generator().manual_seed(11)
    cases = {f"random {M}x{N}": torch.randn(M, N, generator=g).to(torch.bfloat16)
             for M, N in [(1, 49152), (7, 49152), (5, 1000), (3, 17), (4, 7), (2, 1), (9, 33)]}
    # few distinct values: ties everywhere, the first index must win (within a lane, across lanes, in the tail)
    cases["ties"] = torch.randint(0, 3, (6, 1037), generator=g).to(torch.bfloat16)
    ties_late = torch.zeros(3, 100, dtype=torch.bfloat16)
    ties_late[:, [37, 53, 99]] = 1.0   # lanes 5 and 5 of later blocks, and the tail
    cases["tie in later blocks"] = ties_late
    cases["all -inf"] = torch.full((2, 40), float("-inf"), dtype=torch.bfloat16)
    signed_zero = torch.full((2, 40), float("-inf"), dtype=torch.bfloat16)
    signed_zero[0, 20], signed_zero[0, 5] = 0.0, -0.0
    signed_zero[1, 3], signed_zero[1, 30] = 0.0, -0.0
    cases["-0 and +0 tie"] = signed_zero
    nan = torch.randn(4, 300, generator=g).to(torch.bfloat16)
    nan[0, 250] = float("nan")
    nan[1, 2] = float("nan")
    nan[1, 200] = float("nan")
    nan[2, 299] = float("nan")
    cases["NaN counts as the maximum"] = nan
    cases["strided rows"] = torch.randn(5, 2 * 4099, generator=g).to(torch.bfloat16)[:, :4099]
    return cases


def test_argmax_rows_is_torchs_argmax_at_every_isa_level(restore_isa):
    """The native bfloat16 argmax (a greedy step's targets) returns torch's index, the first of
    the maximum, for ties, infinities, signed zeros, NaNs, rows shorter than a vector, tails and
    strided rows, at every ISA level (vector bodies, and the scalar one they fall back to)."""
    cpu_isa = restore_isa
    for isa in cpu_isa.supported():
        cpu_isa.set_isa(isa)
        for name, x in _argmax_cases().items():
            got = cpu_linear.argmax_rows(x)
            assert got.dtype == torch.int64 and got.shape == (x.shape[0],)
            assert torch.equal(got, x.float().argmax(dim=-1)), (isa, name)
    # other dtypes and devices: torch's own
    f = torch.randn(3, 50)
    assert torch.equal(cpu_linear.argmax_rows(f), f.argmax(dim=-1))
