"""Text utilities shared by the engines and the server: stop strings and streaming detokenisation.

Standard library only (no torch), so tools, the server and a future SDK can import it cheaply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from .errors import InvalidRequestError

__all__ = ["MAX_STOPS", "Decoder", "TextStream", "check_stop", "stop_index"]

MAX_STOPS = 16  # stop strings per request


class Decoder(Protocol):
    """What ``TextStream`` needs of a tokenizer."""

    def decode(self, ids: Sequence[int]) -> str: ...


def stop_index(text: str, stops: Sequence[str]) -> int:
    """Where the earliest stop string starts in ``text``; -1 if none does."""
    return min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)


def check_stop(stop: Any) -> list[str]:
    """``stop`` (None, a string, or a list / tuple of strings) as a list of 0-16 non-empty
    strings; anything else raises InvalidRequestError with ``param="stop"``."""
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise InvalidRequestError(f"stop must be a string or a list of strings, got {stop!r}", param="stop")
    if any(s == "" for s in items):
        raise InvalidRequestError("stop strings must not be empty", param="stop")
    if len(items) > MAX_STOPS:
        raise InvalidRequestError(f"at most {MAX_STOPS} stop strings, got {len(items)}", param="stop")
    return list(items)


class TextStream:
    """Incremental detokenisation that never emits text the final answer will not have: no
    half UTF-8 characters, nothing a stop string may still claim.

    ``push(tokens)`` returns the new text that is safe to send; ``finish(final)`` the rest of
    the final answer (the engine's text, already cut at a stop string)."""

    def __init__(self, tokenizer: Decoder, stops: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.sent = ""

    def push(self, tokens: Sequence[int]) -> str:
        self.ids.extend(tokens)
        text = self.tokenizer.decode(self.ids).rstrip("\ufffd")
        cut = stop_index(text, self.stops)
        if cut >= 0:  # a complete stop string: the answer ends before it
            text = text[:cut]
        elif self.hold:
            text = text[:max(len(text) - self.hold, 0)]
        if len(text) > len(self.sent) and text.startswith(self.sent):
            delta, self.sent = text[len(self.sent):], text
            return delta
        return ""

    def finish(self, final: str) -> str:
        delta = final[len(self.sent):] if final.startswith(self.sent) else ""
        self.sent = final
        return delta
