"""What the SDK returns: msgspec Structs, the same in server and in-process mode.

Terms as in DESIGN.md section 4: a *step* is one decode forward after prefill; *MAT* (mean
acceptance length) is the tokens committed per step (accepted draft tokens + 1).
"""

from __future__ import annotations

from typing import Any

import msgspec

from .errors import AgentSpecAPIError

__all__ = ["ApplyResult", "ChatResult", "CompletionResult", "RewriteResult", "SpecStats", "Usage"]


class Usage(msgspec.Struct, kw_only=True):
    """Token counts of one request (the response's ``usage``)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0                          # prompt tokens the server's prefix cache held (0: none or no cache)
    accepted_prediction_tokens: int | None = None   # with a ``prediction``: its tokens the output repeated
    rejected_prediction_tokens: int | None = None

    @classmethod
    def from_body(cls, u: dict | None) -> "Usage":
        u = u or {}
        c = u.get("completion_tokens_details") or {}
        p = u.get("prompt_tokens_details") or {}
        return cls(prompt_tokens=u.get("prompt_tokens", 0), completion_tokens=u.get("completion_tokens", 0),
                   total_tokens=u.get("total_tokens", 0), cached_tokens=p.get("cached_tokens") or 0,
                   accepted_prediction_tokens=c.get("accepted_prediction_tokens"),
                   rejected_prediction_tokens=c.get("rejected_prediction_tokens"))


class SpecStats(msgspec.Struct, kw_only=True):
    """What speculation did for one request (the response's ``spec`` object)."""

    enabled: bool = False
    reason: str = ""                     # why it was off ("" when on)
    route: str = ""                      # the server route that decided
    steps: int = 0
    draft_tokens: int = 0                # proposed and verified
    accepted_tokens: int = 0             # draft tokens that passed verification
    mean_acceptance_length: float = 0.0  # MAT
    acceptance_rate: float = 0.0         # accepted_tokens / draft_tokens
    draft_sources: dict[str, int] = {}   # steps whose draft came from each source
    by_source: dict[str, list[int]] = {}  # per drafter of the tokens: [steps, draft tokens, accepted tokens]
    prefill_ms: float = 0.0              # the server's time to first token
    decode_ms: float = 0.0
    tokens_per_second: float = 0.0       # completion tokens / the server's generation time

    @classmethod
    def from_body(cls, s: dict | None) -> "SpecStats | None":
        if not s:
            return None
        known = {k: v for k, v in s.items() if k in cls.__struct_fields__}
        return msgspec.convert(known, cls)


class _Result(msgspec.Struct, kw_only=True):
    id: str                              # the server's request id (its acceptance-log key)
    model: str
    finish_reason: str                   # "stop" or "length"
    usage: Usage
    spec: SpecStats | None               # None only when a server sent none
    latency_ms: float                    # client-side: the call, end to end
    ttft_ms: float | None = None         # client-side, streams only: the call to the first text


class ChatResult(_Result, kw_only=True):
    """``Client.chat``: the assistant's reply."""

    text: str
    session_id: str | None = None

    @property
    def message(self) -> dict[str, str]:
        """The reply as a chat message, to append to a conversation."""
        return {"role": "assistant", "content": self.text}


class CompletionResult(_Result, kw_only=True):
    """``Client.complete``: the text after a raw prompt."""

    text: str
    session_id: str | None = None


class ApplyResult(_Result, kw_only=True):
    """``Client.apply``: the merged file (the file only: no fence, no chatter)."""

    merged_code: str
    path: str | None = None


class RewriteResult(msgspec.Struct, kw_only=True):
    """``Client.rewrite``: the merged file, its unified diff against the file on disk, and
    whether it was written."""

    path: str
    merged_code: str
    diff: str                            # "" when the model changed nothing
    written: bool
    result: ApplyResult

    @property
    def changed(self) -> bool:
        return bool(self.diff)


def result_from_body(kind: str, body: dict[str, Any], *, latency_ms: float, ttft_ms: float | None = None,
                     session_id: str | None = None) -> Any:
    """The typed result of a response body (or a stream's assembled one) of endpoint ``kind``
    ("chat", "completion", "apply"). A body without a ``finish_reason`` raises
    ``AgentSpecAPIError``: it is cut off, and its text may be too."""
    choice = (body.get("choices") or [{}])[0] if kind != "apply" else body
    finish = choice.get("finish_reason")
    if not finish:   # never assumed: a response without one is incomplete (cut off) or not a server's
        raise AgentSpecAPIError(f"the {kind} response has no finish_reason: it is incomplete")
    common = dict(id=body.get("id", ""), model=body.get("model", ""), usage=Usage.from_body(body.get("usage")),
                  spec=SpecStats.from_body(body.get("spec")), latency_ms=round(latency_ms, 3),
                  ttft_ms=None if ttft_ms is None else round(ttft_ms, 3))
    if kind == "apply":
        return ApplyResult(finish_reason=finish, merged_code=body.get("merged_code", ""), path=body.get("path"),
                           **common)
    if kind == "chat":
        text = (choice.get("message") or {}).get("content") or ""
        return ChatResult(finish_reason=finish, text=text, session_id=session_id, **common)
    return CompletionResult(finish_reason=finish, text=choice.get("text") or "", session_id=session_id, **common)
