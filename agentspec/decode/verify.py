"""Reference tree verification: greedy, and seeded sampling by keyed Gumbel-max.

Terms (as vLLM's rejection sampler uses them): *draft tokens* are proposed; *accepted tokens*
pass verification; the *bonus token* is the one the target adds after the accepted path. The
*acceptance length* of a step is accepted + 1.

Nodes are numbered as the engine forwards them: node 0 is the root (the last committed token,
not yet in the KV cache) and node i + 1 is draft token i. Row i of the target's output is its
distribution for the token after node i.

``greedy_verify`` returns ``(path, bonus)``: the accepted node indices starting with the root,
and the target's token after the last of them. Sampled requests use the same walk with the
target's token at each position drawn by ``seeded_target`` instead of the argmax. The batched
torch and Triton versions of the walk live in ``agentspec.kernels``; they are tested for
equality against ``greedy_verify``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["gumbel_noise", "greedy_verify", "process_logits", "seeded_target"]


def greedy_verify(
    tokens: Sequence[int],     # [T] node tokens, tokens[0] = root
    parents: Sequence[int],    # [T] parent node per node, parents[0] = -1
    target: Sequence[int],     # [T] target argmax after each node
) -> tuple[list[int], int]:
    """Longest root-to-node path whose every token equals the target's argmax at its parent.

    Children are tried in index order; the first match wins.
    """
    children = _children(parents)
    node = 0
    path = [0]
    while True:
        want = target[node]
        nxt = next((c for c in children.get(node, ()) if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def process_logits(
    logits: torch.Tensor,      # [..., V]
    *,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
) -> torch.Tensor:             # [..., V] float32, each row sums to 1
    """The distribution the target samples from: ``softmax(logits / temperature)`` restricted
    to the top-k tokens (ties with the k-th kept) and then to the smallest prefix, by
    probability, whose mass reaches ``top_p``. ``temperature <= 0`` gives the argmax as a
    point mass (the first one on ties), so sampling verification reduces to greedy.
    The engine samples from it through ``seeded_target``.
    """
    x = logits.float()
    if temperature <= 0:
        return torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    x = x / temperature
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_x = sorted_x.masked_fill(drop, -math.inf)
        x = torch.full_like(x, -math.inf).scatter(-1, order, sorted_x)
    return torch.softmax(x, dim=-1)


_M64 = (1 << 64) - 1


def gumbel_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise over the vocabulary for one (seed, position): ``-log(-log U)``,
    float64 on the CPU, a function of its arguments alone. The uniforms come from Philox (a
    counter-based generator) keyed by the full 64-bit seed and the position, so distinct
    (seed, position) pairs never share a stream (a torch CPU generator keeps 32 bits of its seed)."""
    bits = np.random.Philox(key=np.array([int(seed) & _M64, int(position) & _M64], dtype=np.uint64))
    u = np.random.Generator(bits).random(vocab)
    return torch.from_numpy(-np.log(-np.log(u)))


def seeded_target(
    logits: torch.Tensor,      # [V] the target's logits for the token at ``position``
    *,
    seed: int,
    position: int,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
) -> int:
    """The target's sampled token at ``position`` (Gumbel-max): ``argmax(log p + G)``, p =
    ``process_logits(logits, ...)``, G = ``gumbel_noise(seed, position)``. Distributed exactly
    as p; and a function of (seed, position, logits) alone, so a seeded request gives the same
    tokens whatever drafted for it (or nothing did).

    As a verifier (``Decoder.step``): a draft token is accepted iff it equals this token. For
    point-mass (model-free) drafts that accepts a node's children c1, c2, ... with probability
    p(c1) + p(c2) + ..., as recursive rejection sampling (SpecInfer, Sequoia) would, and the
    bonus token is this token at the first position no child matched: it follows p restricted
    to the tokens no child drafted (tests/unit/test_seeded_sampling.py checks both)."""
    p = process_logits(logits, temperature=temperature, top_p=top_p, top_k=top_k)
    score = torch.log(p.double().cpu()) + gumbel_noise(seed, position, p.shape[-1])
    return int(score.argmax())


def _children(parents: Sequence[int]) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for i in range(1, len(parents)):
        children.setdefault(parents[i], []).append(i)
    return children
