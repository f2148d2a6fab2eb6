"""The acceptance replay (benchmarks/replay.py) drafts as the engine would for a recorded turn."""

from __future__ import annotations

import numpy as np

from agentspec.drafting import default_drafter
from benchmarks.replay import replay_drafter


class _Budgets:
    """The real default drafter, recording the budget of every propose call."""

    def __init__(self):
        self.inner = default_drafter()
        self.budgets: list[int] = []

    def start(self, req_id, prompt, *, tenant="default"):
        self.inner.start(req_id, prompt, tenant=tenant)

    def extend(self, req_id, tokens):
        self.inner.extend(req_id, tokens)

    def propose(self, req_id, budget):
        self.budgets.append(budget)
        return self.inner.propose(req_id, budget)

    def stop(self, req_id):
        self.inner.stop(req_id)


def test_last_steps_keep_the_whole_budget():
    """A recorded turn ended by itself (no max_tokens to reach): every step, the last ones too,
    drafts with the request's budget, not one capped by the answer's remaining length."""
    rng = np.random.default_rng(3)
    answer = rng.integers(5, 3000, size=40).astype(np.int64)
    prompt = np.concatenate([rng.integers(5, 3000, size=30), answer, rng.integers(5, 3000, size=5)]).astype(np.int64)
    drafter = _Budgets()
    [rec] = replay_drafter(drafter, [("r", prompt.tolist(), answer)], budget=16, stop_at=1)
    assert sum(a + 1 for a in rec["accepted"]) >= rec["n"]     # the answer was replayed to its end
    assert len(drafter.budgets) == len(rec["accepted"]) > 1
    assert set(drafter.budgets) == {16}
