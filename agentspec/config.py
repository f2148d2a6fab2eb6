"""Configuration structs. Every field says why it exists."""

from __future__ import annotations

import msgspec

from .errors import ConfigError

__all__ = ["SpecConfig"]


class SpecConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How one request speculates. ``spec=None`` on a request means plain decoding."""

    # Max draft tokens verified per step (tree nodes, root excluded). Rewrites copying a file pay
    # off with long drafts; the engine also caps it by the tokens still to generate.
    budget: int = 32
    # Stop a draft once the drafter's survival estimate for a token falls below this.
    min_prob: float = 0.0
    # Cost of one more verified token relative to a one-token step. Drafts are cut to the prefix
    # that maximises expected tokens per step cost (agentspec.drafting.base.cut_for_cost), so
    # speculation does not make steps slower than it gains. None: the engine's own figure,
    # profiled at start-up (``engine.row_cost``); 0: always verify the whole draft.
    row_cost: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.budget, int) or isinstance(self.budget, bool) or self.budget < 0:
            raise ConfigError(f"SpecConfig.budget must be an int >= 0, got {self.budget!r}")
        if self.budget > 1024:
            raise ConfigError(f"SpecConfig.budget must be <= 1024, got {self.budget!r}")
        if self.row_cost is not None and (isinstance(self.row_cost, bool) or not isinstance(self.row_cost, (int, float))
                                          or not 0.0 <= self.row_cost <= 10.0):
            raise ConfigError(f"SpecConfig.row_cost must be None or a number in [0, 10], got {self.row_cost!r}")
        if not 0.0 <= float(self.min_prob) <= 1.0:
            raise ConfigError(f"SpecConfig.min_prob must be in [0, 1], got {self.min_prob!r}")
