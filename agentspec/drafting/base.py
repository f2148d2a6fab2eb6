"""The drafter role: one protocol, one draft shape (a tree), shared by every drafting method."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import msgspec

__all__ = ["Draft", "Drafter", "EMPTY_DRAFT"]


class Draft(msgspec.Struct, frozen=True):
    """A draft tree. A linear draft has parents ``[-1, 0, 1, ...]``.

    ``parents[i]`` is the index of token i's parent in ``token_ids`` (always < i), or -1 for the
    last committed token. ``probs[i]`` is the drafter's confidence that token i survives given
    its parent survived; a token's survival estimate is the product along its path.
    """

    token_ids: list[int]
    parents: list[int]
    probs: list[float]
    score: float = 0.0   # expected accepted tokens (sum of survival estimates)
    source: str = ""     # "prompt_lookup", "suffix:request", "suffix:workspace", ...

    def __len__(self) -> int:
        return len(self.token_ids)

    def validate(self, budget: int) -> None:
        """Raise ValueError if this is not a well-formed tree of at most ``budget`` tokens."""
        n = len(self.token_ids)
        if len(self.parents) != n or len(self.probs) != n:
            raise ValueError(
                f"draft from {self.source!r}: token_ids, parents and probs differ in length "
                f"({n}, {len(self.parents)}, {len(self.probs)})"
            )
        if n > budget:
            raise ValueError(f"draft from {self.source!r} has {n} tokens, over the budget of {budget}")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"draft from {self.source!r}: parents[{i}] = {p} must be in [-1, {i})")

    @staticmethod
    def chain(token_ids: Sequence[int], probs: Sequence[float] | float = 1.0, *, source: str = "") -> "Draft":
        """A linear draft; ``probs`` per token or one value for all."""
        n = len(token_ids)
        p = [float(probs)] * n if isinstance(probs, (int, float)) else [float(x) for x in probs]
        survival, score = 1.0, 0.0
        for x in p:
            survival *= x
            score += survival
        return Draft([int(t) for t in token_ids], list(range(-1, n - 1)), p, score, source)


EMPTY_DRAFT = Draft([], [], [], 0.0, "")


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft trees for running requests.

    ``start`` opens a request with its prompt; ``extend`` reports tokens now committed (accepted
    tokens and the bonus token); ``propose`` returns a draft of at most ``budget`` tokens that
    continues the committed sequence; ``stop`` releases the request.
    """

    def start(self, req_id: str, prompt: Sequence[int], *, tenant: str = "default") -> None: ...

    def extend(self, req_id: str, tokens: Sequence[int]) -> None: ...

    def propose(self, req_id: str, budget: int) -> Draft: ...

    def stop(self, req_id: str) -> None: ...
