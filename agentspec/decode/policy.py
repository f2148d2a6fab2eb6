"""The draft policy: how much of a drafter's tree one decode step verifies.

One object, used by every path that turns a drafter's proposal into the rows a step verifies:
single-request decoding, continuous batching (``agentspec.decode.step``) and the acceptance
replay (``benchmarks/replay.py``). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import SpecConfig
from ..drafting.draft import EMPTY_DRAFT, Draft, cut_for_cost, drop_unlikely

__all__ = ["MAX_STEP_ROWS", "DraftPolicy", "main_chain"]

# Most rows one request verifies in one decode step (the root and up to 127 draft tokens): what
# the engine's row-invariant decode kernels take in one forward (``agentspec.backends.embedded.model.SMALL_T``).
MAX_STEP_ROWS = 128


@dataclass(frozen=True)
class DraftPolicy:
    """Budget, ``min_prob``, cost cut and trust for one request's drafts.

    budget: most draft tokens per step (the request's ``SpecConfig.budget``, clamped to what one
      forward verifies: ``max_rows - 1``; the clamp is recorded in ``note``).
    min_prob: drop tokens whose survival estimate is below this (``drop_unlikely``).
    row_cost: cost of one more verified token relative to a one-token step; a draft is cut to
      the prefix that maximises expected tokens per step cost (``cut_for_cost``), its estimates
      scaled by the request's trust (observed accepted / estimated, ``AcceptanceTracker``).
      0 keeps the whole draft.
    chain_only: verify the first root-to-leaf chain only (the engine's deterministic mode).
    forced_drafts: where the request's grammar forces the next tokens, they lead its draft.
    """

    budget: int = 0
    min_prob: float = 0.0
    row_cost: float = 0.0
    chain_only: bool = False
    forced_drafts: bool = True   # a grammar's forced tokens are drafted (``SpecConfig.forced_drafts``)
    note: str = ""        # why the budget is lower than the request asked ("" when it is not)

    @classmethod
    def for_request(cls, spec: SpecConfig | None, *, row_cost: float, max_rows: int,
                    chain_only: bool = False) -> "DraftPolicy":
        """The policy for a request with ``spec`` (None: no drafts) on an engine whose profiled
        row cost is ``row_cost`` and whose step verifies at most ``max_rows`` rows per request."""
        if spec is None or spec.budget == 0:
            return cls()
        budget, note = spec.budget, ""
        if budget > max_rows - 1:
            budget = max_rows - 1
            note = f"budget {spec.budget} clamped to {budget} (a step verifies at most {max_rows} rows per request)"
        return cls(budget=budget, min_prob=float(spec.min_prob),
                   row_cost=float(row_cost if spec.row_cost is None else spec.row_cost), chain_only=chain_only,
                   forced_drafts=bool(spec.forced_drafts), note=note)

    def budget_for(self, remaining: int) -> int:
        """Draft tokens worth proposing when ``remaining`` tokens are still to generate (the
        bonus token comes free, so at most ``remaining - 1``)."""
        return max(min(self.budget, remaining - 1), 0)

    def shape(self, draft: Draft, *, trust: float = 1.0, cost_cut: bool = True) -> Draft:
        """``draft`` as this policy verifies it. ``cost_cut=False`` leaves the cost cut to the
        caller (the load-aware batch budget chooses slots across requests instead)."""
        if not draft.token_ids:
            return draft
        if self.min_prob > 0:
            draft = drop_unlikely(draft, self.min_prob)
        if self.chain_only:
            return main_chain(draft)
        if cost_cut and self.row_cost > 0:
            draft = cut_for_cost(draft, self.row_cost, trust)
        return draft


def main_chain(draft: Draft) -> Draft:
    """The first root-to-leaf chain of a tree (its nodes keep their sources)."""
    if not draft.token_ids:
        return EMPTY_DRAFT
    keep: list[int] = []
    last = -1
    for i, p in enumerate(draft.parents):
        if p == last:
            keep.append(i)
            last = i
    return draft.select(keep)
