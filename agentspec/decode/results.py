"""What a generation returns: its tokens and text (``Generation``) and what its steps did
(``GenerationStats``). Made by the decode step; every backend returns them."""

from __future__ import annotations

import msgspec

__all__ = ["Generation", "GenerationStats"]


class GenerationStats(msgspec.Struct, kw_only=True):
    """What one generation did. A *step* is one decode forward after prefill."""

    prompt_tokens: int
    completion_tokens: int = 0
    spec_enabled: bool = False
    spec_reason: str = ""          # why speculation is on or off for this request
    seed: int | None = None        # a sampled request's seed (drawn at random when it gave none): rerun with it
    steps: int = 0
    draft_tokens: int = 0          # proposed and verified
    accepted_tokens: int = 0       # draft tokens that passed verification
    acceptance_lengths: list[int] = []  # per step: accepted + 1 (the bonus token)
    draft_depths: list[int] = []   # per step: depth of the verified draft tree (0: no draft)
    mean_acceptance_length: float = 0.0  # MAT over steps
    draft_sources: dict[str, int] = {}   # steps whose draft came from each source (``Draft.source``)
    # by the source of each draft node (``Draft.source_of``: a merged draft's nodes name their own
    # drafter, e.g. "suffix" and "eagle3" under "suffix+eagle3"):
    source_steps: dict[str, int] = {}    # steps whose verified draft had nodes from the source
    source_drafted: dict[str, int] = {}  # draft tokens proposed and verified
    source_accepted: dict[str, int] = {}  # draft tokens that passed verification (same keys)
    cached_tokens: int = 0         # prompt tokens whose KV came from the prefix cache (not prefilled)
    prefill_seconds: float = 0.0   # time to first token
    decode_seconds: float = 0.0
    draft_seconds: float = 0.0     # time inside the drafter (propose + extend)
    grammar_seconds: float = 0.0   # a request with a grammar: time in it (compile, masks, draft pruning)
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0


class Generation(msgspec.Struct, kw_only=True):
    text: str
    token_ids: list[int]
    finish_reason: str             # "stop" (EOS or a stop string) or "length" (max_tokens)
    stats: GenerationStats
