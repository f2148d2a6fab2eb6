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
    chain_probs,
    compose,
    geometric_probs,
    head_drafts,
    top_probs,
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
    with pytest.raises(ValueError, match="'lookahead' does not run here"):   # start-up refuses such routes
        compose(["lookahead"], s, h, 1.0)
    switch = compose(["suffix>eagle3"], s, h, 2.5)
    assert isinstance(switch, FallbackDrafter) and switch.mode == "switch" and switch.min_expected == 3.0
    assert compose(["suffix>eagle3"], s, h, 4.5).min_expected == 4.5
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


def _verify(tokens, nxt, sib):
    import torch
    from types import SimpleNamespace

    return SimpleNamespace(draft_token=torch.tensor(tokens), retrieve_next_token=torch.tensor(nxt),
                           retrieve_next_sibling=torch.tensor(sib))


def test_head_drafts_carry_the_heads_own_confidence_per_depth():
    # two requests, width 4: request 0 a chain 7 -> 8 -> 9, request 1 a chain 5 -> 6 (row 3 unused)
    v = _verify([0, 7, 8, 9, 0, 5, 6, 0], [1, 2, 3, -1, 1, 2, -1, -1], [-1] * 8)
    conf = [[0.9, 0.5, 0.2], [0.99, 0.1, 0.3]]
    d0, d1 = head_drafts(v, 2, 4, conf)
    assert d0.token_ids == [7, 8, 9] and d0.parents == [-1, 0, 1] and d0.probs == pytest.approx([0.9, 0.5, 0.2])
    assert d0.expected() == pytest.approx(0.9 + 0.45 + 0.09)
    assert d1.token_ids == [5, 6] and d1.probs == pytest.approx([0.99, 0.1])
    # without confidences the chain has probability 1 and calibrated() sets the measured mean
    plain = head_drafts(v, 2, 4)[0]
    assert plain.probs == [1.0, 1.0, 1.0]
    assert calibrated(plain, 1.5).expected() == pytest.approx(1.5, abs=1e-3)


def test_chain_probs_refuse_what_was_not_measured_for_every_node():
    assert chain_probs([0.5, 0.6], [[0.1, 0.2], [0.3, 0.4]], 2, 3) == [[0.5, 0.1, 0.3], [0.6, 0.2, 0.4]]
    assert chain_probs(None, [[0.1, 0.2]], 2, 2) is None            # no first-node confidence
    assert chain_probs([0.5, 0.6], [[0.1, 0.2]], 2, 3) is None      # a forward not captured (CUDA graph)
    assert chain_probs([0.5], [[0.1, 0.2]], 2, 2) is None           # batch sizes disagree


def test_top_probs_are_each_rows_softmax_maximum():
    import torch

    logits = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 0.0]], dtype=torch.bfloat16)
    p = top_probs(logits)
    assert p[0] == pytest.approx(0.5) and p[1] == pytest.approx(1 / (1 + 2.718281828 ** -10), rel=1e-4)


def test_switch_follows_the_heads_confidence_node_by_node():
    suffix = _Stub(Draft.chain([1, 2, 3], 0.7, source="suffix"))      # expects 0.7 + 0.49 + 0.343
    sure = _Stub(Draft([4, 5, 6], [-1, 0, 1], [0.95, 0.9, 0.9], 0.0, "eagle3"))
    unsure = _Stub(Draft([4, 5, 6], [-1, 0, 1], [0.6, 0.3, 0.3], 0.0, "eagle3"))
    assert compose(["suffix>eagle3"], suffix, sure, 0.0).propose("r", 7).source == "eagle3"
    assert compose(["suffix>eagle3"], suffix, unsure, 0.0).propose("r", 7).source == "suffix"
    # merged as siblings, the budget goes to the nodes most likely to survive, whichever drafter
    m = compose(["suffix", "eagle3"], suffix, sure, 0.0).propose("r", 4)
    assert m.token_ids == [4, 5, 6, 1]
