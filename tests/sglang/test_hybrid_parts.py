"""The hybrid worker's pieces without an engine: verify rows and tree links from a draft, the
drafter a request's list composes, the head's calibrated confidence, and the per-step source
records the front reads back (what ``test_agentspec_hybrid.py`` runs inside real SGLang)."""

from __future__ import annotations

import pytest

from helpers.sglang import require_sglang

require_sglang()   # before anything that imports SGLang

from agentspec.drafting import Draft, FallbackDrafter  # noqa: E402
from agentspec.integrations.sglang.config import read_source_records, source_record  # noqa: E402
from agentspec.integrations.sglang.hybrid import (  # noqa: E402
    HeadEstimate,
    calibrated,
    compose,
    geometric_probs,
    tree_links,
    tree_rows,
)


def test_tree_rows_pad_with_orphans_no_walk_reaches():
    d = Draft([5, 6, 7], [-1, 0, 0], [1.0, 1.0, 0.5])
    tokens, parents, depths = tree_rows(d, 9, 6)
    assert tokens == [9, 5, 6, 7, 9, 9]
    assert parents == [-1, 0, 1, 1, -2, -2]
    assert depths == [0, 1, 2, 2, 1, 1]
    mask, nxt, sib = tree_links(parents)
    assert nxt.tolist() == [1, 2, -1, -1, -1, -1]
    assert sib.tolist() == [-1, -1, 3, -1, -1, -1]
    # a walk from the root (first child, then siblings) never reaches rows 4 and 5
    seen, stack = set(), [0]
    while stack:
        n = stack.pop()
        seen.add(n)
        c = nxt[n]
        while c != -1:
            stack.append(int(c))
            c = sib[c]
    assert seen == {0, 1, 2, 3}
    assert mask[3].tolist() == [True, True, False, True, False, False]
    assert mask[4].tolist() == [False, False, False, False, True, False]


def test_tree_rows_cut_to_the_width():
    d = Draft.chain([1, 2, 3, 4, 5])
    tokens, parents, _ = tree_rows(d, 0, 4)
    assert tokens == [0, 1, 2, 3] and parents == [-1, 0, 1, 2]


class _Stub:
    def __init__(self, draft):
        self.draft = draft

    def propose(self, req_id, budget):
        return self.draft.prefix(budget)


def test_compose_follows_the_registry_meaning_of_drafter_lists():
    s, h = _Stub(Draft.chain([1, 2], 0.9, source="suffix")), _Stub(Draft.chain([3], 1.0, source="eagle3"))
    assert compose(["suffix"], s, h, 1.0) is s
    assert compose(["eagle3"], s, h, 1.0) is h
    assert compose(["lookahead"], s, h, 1.0) is None
    switch = compose(["suffix>eagle3"], s, h, 2.5)
    assert isinstance(switch, FallbackDrafter) and switch.mode == "switch" and switch.min_expected == 2.5
    merged = compose(["suffix", "eagle3"], s, h, 2.5)
    assert merged.mode == "merge"
    # switch: the suffix draft (expects 0.9 + 0.81) loses to a head expecting 2.5 ...
    head = _Stub(calibrated(Draft([3, 4, 5], [-1, 0, 1], [1.0, 1.0, 1.0], 3.0, "eagle3"), 2.5))
    assert compose(["suffix>eagle3"], s, head, 2.5).propose("r", 7).source == "eagle3"
    # ... and wins against one expecting 1.0
    head = _Stub(calibrated(Draft([3, 4, 5], [-1, 0, 1], [1.0, 1.0, 1.0], 3.0, "eagle3"), 1.0))
    assert compose(["suffix>eagle3"], s, head, 1.0).propose("r", 7).source == "suffix"


@pytest.mark.parametrize("expected,length", [(0.0, 4), (1.0, 7), (3.5, 4), (9.0, 3)])
def test_geometric_probs_hit_the_expected_length(expected, length):
    p = geometric_probs(expected, length)[0]
    total = sum(p ** k for k in range(1, length + 1))
    assert total == pytest.approx(min(expected, length), abs=1e-3)


def test_head_estimate_is_a_decayed_mean_with_a_shared_prior():
    e = HeadEstimate(prior=1.0, decay=0.5)
    assert e.get("a") == 1.0
    e.observe("a", 3)
    assert e.get("a") == 2.0 and e.prior == 2.0
    assert e.get("b") == 2.0          # a new request starts from the mean over all
    e.drop("a")
    assert e.get("a") == 2.0


def test_source_records_round_trip_and_skip_junk():
    values = [None, source_record({"suffix": (5, 3)}), None, None, None,
              source_record({"suffix": (2, 0), "eagle3": (4, 1)}), None, "garbage", 7, "x:y:z"]
    assert read_source_records(values) == {"suffix": [2, 7, 3], "eagle3": [1, 4, 1]}
    assert read_source_records(None) == {}
