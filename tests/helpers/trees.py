"""Draft trees for exactness tests: a chain with a decoy sibling beside every token (shared by
test_engine_exactness.py and test_families.py)."""

from __future__ import annotations

import random


def with_decoys(chain, budget: int, rng: random.Random, vocab: int) -> tuple[list[int], list[int]]:
    """``chain``'s tokens, each with a random decoy sibling at a random slot, within ``budget``:
    (token_ids, parents), parents before children. The verifier must pick non-first branches."""
    tokens: list[int] = []
    parents: list[int] = []
    parent = -1
    for t in chain:
        if len(tokens) + 2 > budget:
            break
        decoy = (t + 1 + rng.randrange(vocab - 1)) % vocab
        pair = [decoy, t] if rng.random() < 0.5 else [t, decoy]
        for tok in pair:
            tokens.append(tok)
            parents.append(parent)
        parent = len(tokens) - (1 if pair[1] == t else 2)
    return tokens, parents
