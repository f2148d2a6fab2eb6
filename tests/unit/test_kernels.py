"""Triton tree kernels against their torch references.

Without CUDA the kernels run in Triton's interpreter on CPU tensors: ``TRITON_INTERPRET=1``
must be set before the kernels are decorated, so it is set here at import, before anything
imports ``agentspec.kernels.tree_triton`` (guarded: never when CUDA is present, and a module
already compiled for the GPU is reported rather than silently reused). With CUDA the same
comparisons run the real kernels, and the ``gpu`` tests add realistic sizes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

CUDA = torch.cuda.is_available()
if not CUDA and "agentspec.kernels.tree_triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton", reason="the Triton kernels need triton (extra [dev])")

from agentspec import kernels as K  # noqa: E402
from agentspec.kernels import tree_triton  # noqa: E402
from agentspec.decode.verify import greedy_verify  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
if not CUDA and not tree_triton.INTERPRETED:
    pytest.skip("agentspec.kernels.tree_triton was imported before TRITON_INTERPRET could be set",
                allow_module_level=True)


def _random_batch(g: torch.Generator, *, trees: int, max_nodes: int, vocab: int):
    out = []
    for _ in range(trees):
        n = int(torch.randint(1, max_nodes + 1, (1,), generator=g))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        tokens = torch.randint(0, vocab, (n,), generator=g).tolist()
        out.append((tokens, parents))
    return out


def pack_trees(trees, *, device=None):
    """``[(tokens, parents), ...]`` (root included) -> flat ``tokens [N]``, ``parents [N]``,
    ``offsets [B + 1]`` (int64): the batched layout of ``agentspec.kernels.tree``."""
    lengths = [len(t) for t, _ in trees]
    offsets = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    tokens = torch.tensor([x for t, _ in trees for x in t], dtype=torch.int64)
    parents = torch.tensor([x for _, p in trees for x in p], dtype=torch.int64)
    return tokens.to(device), parents.to(device), offsets.to(device)


def _assert_same(a, b):
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu()), (x, y)


@st.composite
def greedy_batches(draw, max_trees=4, max_nodes=10, vocab=3):
    trees, targets = [], []
    for _ in range(draw(st.integers(1, max_trees))):
        n = draw(st.integers(1, max_nodes))
        parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
        trees.append((draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)), parents))
        targets += draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    return trees, targets


@given(greedy_batches())
@settings(max_examples=60 if not CUDA else 300, deadline=None)
def test_greedy_kernel_matches_reference(batch):
    trees, targets = batch
    tok, par, off = pack_trees(trees, device=DEV)
    target = torch.tensor(targets, device=DEV)
    ref = K.greedy_verify_batch_torch(tok, par, target, off)
    _assert_same(K.greedy_verify_batch_triton(tok, par, target, off), ref)
    paths, lengths, bonus = ref
    start = 0
    for b, (tokens, parents) in enumerate(trees):
        want = greedy_verify(tokens, parents, targets[start:start + len(tokens)])
        assert (paths[b, :lengths[b]].tolist(), int(bonus[b])) == want
        start += len(tokens)


def test_greedy_dispatcher_defaults():
    tok, par, off = pack_trees([([5, 1, 2], [-1, 0, 1]), ([7, 3], [-1, 0])], device=DEV)
    paths, lengths, bonus = K.greedy_verify_batch(tok, par, torch.tensor([1, 2, 9, 4, 4], device=DEV), off)
    assert paths.tolist() == [[0, 1, 2], [0, -1, -1]] and lengths.tolist() == [3, 1] and bonus.tolist() == [9, 4]


def test_kernels_validate_inputs():
    tok, par, off = pack_trees([([1, 2], [-1, 0])], device=DEV)
    with pytest.raises(ValueError, match=r"parents\[0\] = 0 \(row 0 of its tree\) must be -1"):
        K.greedy_verify_batch_triton(tok, torch.zeros_like(par), tok, off)


def test_missing_triton_names_the_install(monkeypatch):
    monkeypatch.delitem(sys.modules, "agentspec.kernels.tree_triton")
    monkeypatch.delattr(K, "tree_triton")
    monkeypatch.setitem(sys.modules, "triton", None)
    tok, par, off = pack_trees([([1], [-1])])
    with pytest.raises(ImportError, match=r"need triton: pip install triton"):
        K.greedy_verify_batch_triton(tok, par, tok, off)


def test_kernels_compile_for_cuda():
    """The real (non-interpreted) kernels compile to sm_90 cubins; no GPU needed (fresh
    process: this one has the interpreted kernels)."""
    code = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from agentspec.kernels import tree_triton as K
        i64 = "*i64"
        sigs = {
            K._greedy_kernel: ([i64] * 7 + ["i32"], {}),
        }
        for fn, (types, consts) in sigs.items():
            sig = dict(zip(fn.arg_names, types))
            src = ASTSource(fn=fn, signature=sig,
                            constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
            assert compiled.asm["cubin"], fn
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-W", "error", "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if r.returncode and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip(f"no ptxas to compile with: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_kernels_on_cuda_at_real_sizes():
    g = torch.Generator().manual_seed(3)
    batch = _random_batch(g, trees=64, max_nodes=64, vocab=151_936)
    tok, par, off = pack_trees(batch, device="cuda")
    N, V = tok.numel(), 151_936
    target = torch.randint(0, V, (N,), device="cuda")
    # row i often wants the next row's token (a child on chains): long accepted paths
    target[:-1] = torch.where(torch.rand(N - 1, device="cuda") < 0.7, tok[1:], target[:-1])
    _assert_same(K.greedy_verify_batch(tok, par, target, off), K.greedy_verify_batch_torch(tok, par, target, off))
