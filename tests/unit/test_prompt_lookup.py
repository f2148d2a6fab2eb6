from __future__ import annotations

import numpy as np
import pytest

from agentspec.drafting import Drafter, PromptLookupDrafter, default_drafter


def test_default_drafter_is_a_drafter():
    d = default_drafter()
    assert isinstance(d, Drafter)
    d.start("r", [1, 2, 3, 4, 1, 2])
    draft = d.propose("r", 8)
    assert draft.token_ids == [3, 4, 1, 2]
    d.stop("r")


def test_copy_pointer_resynchronises_after_an_edit():
    src = list(range(100, 160))
    d = PromptLookupDrafter(min_ngram=2)
    d.start("r", src + [7])  # prompt holds the source; the response starts rewriting it
    d.extend("r", src[:10])
    assert d.propose("r", 5).token_ids == src[10:15]
    # the response inserts an edit (tokens not in the source), then continues with src[20:]
    d.extend("r", [1, 2, 3])
    assert d.propose("r", 5).token_ids == []
    d.extend("r", src[20:22])
    short = d.propose("r", 16).token_ids  # a fresh, short agreement earns a short draft
    assert 1 <= len(short) < 16 and short == src[22:22 + len(short)]
    d.extend("r", src[22:30])
    assert d.propose("r", 16).token_ids == src[30:46]  # long agreement: the whole budget


def test_longest_agreement_wins_over_recency():
    # "a b X" early with long agreement, "b Y" later with short agreement
    prompt = [1, 2, 3, 4, 50, 60, 9, 9, 4, 70]
    d = PromptLookupDrafter(min_ngram=1, max_ngram=1)
    d.start("r", prompt)
    d.extend("r", [1, 2, 3, 4])
    assert d.propose("r", 2).token_ids == [50, 60]


def test_numpy_prompt_and_budget_zero():
    d = PromptLookupDrafter()
    d.start("r", np.array([5, 6, 7, 5, 6], dtype=np.int64))
    assert d.propose("r", 0).token_ids == []
    assert d.propose("r", 1).token_ids == [7]


def test_bad_input():
    d = PromptLookupDrafter()
    with pytest.raises(ValueError, match="unknown request id 'nope'"):
        d.propose("nope", 4)
    d.start("a", [1, 2])
    with pytest.raises(ValueError, match="already started"):
        d.start("a", [1])
    with pytest.raises(ValueError, match="budget must be >= 0, got -1"):
        d.propose("a", -1)
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDrafter(min_ngram=3, max_ngram=2)
    d.stop("a")
    d.stop("a")  # stopping twice is harmless


def test_several_candidates_make_a_tree():
    # "5 6" is followed once by "7 8" and once by "9 9": both continuations become branches
    d = PromptLookupDrafter()
    d.start("r", [5, 6, 7, 8, 0, 1, 5, 6, 9, 9, 0, 2, 5, 6])
    draft = d.propose("r", 8)
    draft.validate(8)
    roots = [t for t, p in zip(draft.token_ids, draft.parents) if p == -1]
    assert sorted(roots) == [7, 9]
    assert 0 < draft.score <= len(draft)
    assert all(0.0 < p <= 1.0 for p in draft.probs)
