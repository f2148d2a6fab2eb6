"""Reference tree verification.

Terms (as vLLM's rejection sampler uses them): *draft tokens* are proposed; *accepted tokens*
pass verification; the *bonus token* is the one the target adds after the accepted path. The
*acceptance length* of a step is accepted + 1.

Nodes are numbered as the engine forwards them: node 0 is the root (the last committed token,
not yet in the KV cache) and node i + 1 is draft token i.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["greedy_verify"]


def greedy_verify(
    tokens: Sequence[int],     # [T] node tokens, tokens[0] = root
    parents: Sequence[int],    # [T] parent node per node, parents[0] = -1
    target: Sequence[int],     # [T] target argmax after each node
) -> tuple[list[int], int]:
    """Longest root-to-node path whose every token equals the target's argmax at its parent.

    Returns ``(path, bonus)``: the accepted node indices starting with the root, and the
    target's token after the last of them.
    """
    children: dict[int, list[int]] = {}
    for i in range(1, len(parents)):
        children.setdefault(parents[i], []).append(i)
    node = 0
    path = [0]
    while True:
        want = target[node]
        nxt = next((c for c in children.get(node, ()) if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt
