from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentspec.drafting import Draft
from agentspec.kernels import tree_depths, tree_mask, with_root
from agentspec.decode.verify import greedy_verify


@st.composite
def trees(draw, max_nodes=12, vocab=4):
    n = draw(st.integers(1, max_nodes))
    parents = [-1]
    for i in range(1, n):
        parents.append(draw(st.integers(0, i - 1)))
    tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    target = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    return tokens, parents, target


def brute_force_verify(tokens, parents, target):
    """Try every node: the accepted path is the deepest one whose every step matches (first on ties)."""
    best = [0]
    for node in range(len(tokens)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        if all(tokens[c] == target[p] for p, c in zip(path, path[1:])) and len(path) > len(best):
            best = path
    return best, target[best[-1]]


def test_tree_mask_chain_is_causal():
    m = tree_mask([-1, 0, 1, 2])
    assert torch.equal(m, torch.ones(4, 4, dtype=torch.bool).tril())


def test_tree_mask_and_depths_branching():
    parents = [-1, 0, 0, 1, 2]
    m = tree_mask(parents)
    assert m[3].tolist() == [True, True, False, True, False]
    assert m[4].tolist() == [True, False, True, False, True]
    assert tree_depths(parents) == [0, 1, 1, 2, 2]
    assert with_root([-1, 0, -1]) == [-1, 0, 1, 0]


@given(trees())
@settings(max_examples=300, deadline=None)
def test_greedy_verify_matches_brute_force(tree):
    tokens, parents, target = tree
    path, bonus = greedy_verify(tokens, parents, target)
    ref_path, ref_bonus = brute_force_verify(tokens, parents, target)
    # siblings carry distinct tokens in real drafts; with duplicates both pick the first match
    if len(path) == len(ref_path):
        assert bonus == target[path[-1]]
    assert len(path) == len(ref_path) or _has_duplicate_siblings(tokens, parents)
    assert path[0] == 0
    for p, c in zip(path, path[1:]):
        assert parents[c] == p and tokens[c] == target[p]


def _has_duplicate_siblings(tokens, parents):
    seen = set()
    for i in range(1, len(tokens)):
        key = (parents[i], tokens[i])
        if key in seen:
            return True
        seen.add(key)
    return False


def test_greedy_verify_rejects_everything():
    path, bonus = greedy_verify([5, 1, 2], [-1, 0, 1], [9, 9, 9])
    assert path == [0] and bonus == 9


def test_draft_validate_and_chain():
    d = Draft.chain([4, 5, 6], 0.5, source="x")
    assert d.parents == [-1, 0, 1]
    assert d.score == pytest.approx(0.5 + 0.25 + 0.125)
    d.validate(3)
    with pytest.raises(ValueError, match="over the budget of 2"):
        d.validate(2)
    with pytest.raises(ValueError, match=r"parents\[1\] = 1"):
        Draft([1, 2], [-1, 1], [1.0, 1.0]).validate(5)
    with pytest.raises(ValueError, match="differ in length"):
        Draft([1, 2], [-1], [1.0, 1.0]).validate(5)
