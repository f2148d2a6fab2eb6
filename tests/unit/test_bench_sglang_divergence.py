"""benchmarks/bench_sglang.py's divergence report and concurrency levels (no SGLang needed)."""

from __future__ import annotations

import pytest

from benchmarks.bench_sglang import concurrency_levels, divergences, first_divergence, summarize


def test_first_divergence_reports_the_first_differing_token_and_the_margin():
    ref = [5, 6, 7, 8]
    top = [[[-0.1, 5], [-3.0, 9]], [[-0.2, 6], [-2.0, 1]], [[-0.69, 7], [-0.70, 11]], [[-0.1, 8], [-4, 2]]]
    assert first_divergence(ref, list(ref), top) is None
    d = first_divergence(ref, [5, 6, 11, 3], top)
    assert d["position"] == 2 and d["none_token"] == 7 and d["token"] == 11
    assert d["none_top2"] == [[7, -0.69], [11, -0.7]]
    assert d["margin"] == pytest.approx(0.01)
    assert d["token_is_none_second_choice"] is True
    d = first_divergence(ref, [5, 4], top)
    assert d["position"] == 1 and d["token_is_none_second_choice"] is False and d["margin"] == pytest.approx(1.8)
    # one output a prefix of the other (a stop token): the divergence is where the shorter ends
    d = first_divergence(ref, [5, 6], None)
    assert d == {"position": 2, "none_token": 7, "token": None}
    # no log-probabilities: position and tokens only
    assert "margin" not in first_divergence(ref, [1, 6, 7, 8])


def _row(ids, top=None):
    return {"output_ids": ids, "seconds": 1.0, "completion_tokens": len(ids), "spec": {}, "by_source": {},
            **({"top_logprobs": top} if top else {})}


def test_divergences_and_identical_counts_per_concurrency():
    top = [[[-0.1, 1], [-0.3, 9]], [[-0.1, 2], [-5.0, 3]]]
    raw = {"none": {"startup_s": 1, "workloads": {"agent": [_row([1, 2], top), _row([4, 4])],
                                                  "agent@c16": [_row([1, 2]), _row([4, 5])]}},
           "ngram": {"startup_s": 1, "workloads": {"agent": [_row([9, 2]), _row([4, 4])],
                                                   "agent@c16": [_row([1, 2]), _row([4, 5])]}}}
    found = divergences(raw)
    assert {(d["method"], d["workload"], d["prompt"]) for d in found} == {("ngram", "agent", 0), ("none", "agent@c16", 1)}
    first = next(d for d in found if d["method"] == "ngram")
    assert first["token_is_none_second_choice"] and first["margin"] == pytest.approx(0.2)
    assert next(d for d in found if d["method"] == "none")["against"] == "none@c1"
    res = summarize(raw)
    assert res["ngram"]["agent"]["identical_to_none"] == "1/2"
    assert res["ngram"]["agent@c16"]["identical_to_none"] == "2/2"
    assert res["none"]["agent@c16"]["identical_to_c1"] == "1/2"
    assert res["ngram"]["agent@c16"]["tokens_per_s"] is None   # a batch's speed is in "batches"


def test_concurrency_levels():
    assert concurrency_levels("16,1") == [1, 16]
    assert concurrency_levels("1") == [1]
    with pytest.raises(SystemExit):
        concurrency_levels("0,4")
