"""Sessions: a session id pins one tenant's conversation (issue 17).

A session id names an agent loop's conversation. Its first use binds it to the tenant that used
it; from then on only that tenant may use it. Where a request's session comes from, first found:

* ``session`` (extension, body field of chat, completions and apply): an explicit id that must
  already exist for the caller's tenant -- created by ``POST /v1/sessions`` or by an earlier
  request that used the id as ``prompt_cache_key``. Unknown: 404 ``session_not_found``.
* ``prompt_cache_key`` (OpenAI semantics): the id is created on first use.
* ``user``, when neither is given: OpenAI's end-user id, which two tenants may both use; it names
  the session of the tenant's own records and is never bound (nor refused).

Sessions are per tenant: the registry is keyed by (tenant, id), so two tenants may use the same id
without meeting, no tenant can take an id another uses, and another tenant's session is simply
unknown (404, the same answer as an id never created: nothing tells a tenant which ids others
use). A session id is at most ``MAX_SESSION_ID`` characters (longer: 400).

The registry is in memory and bounded per tenant: at most ``max_sessions`` ids each (default
10,000), least recently used dropped first, so a tenant creating sessions in a loop drops only its
own. A dropped (or pre-restart) id is forgotten: an explicit ``session`` naming it gets 404, and
``prompt_cache_key`` binds it afresh. All methods are thread-safe (one lock).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["MAX_SESSION_ID", "Session", "SessionNotFoundError", "SessionRegistry"]

MAX_SESSION_ID = 512


class SessionNotFoundError(LookupError):
    """The tenant has no session with this id (never created, dropped from the bounded registry,
    or another tenant's: the same answer)."""


@dataclass(frozen=True)
class Session:
    id: str
    tenant: str
    created: int   # unix time it was bound

    def body(self) -> dict:
        return {"id": self.id, "object": "session", "created": self.created}


class SessionRegistry:
    """(tenant, session id) -> session, bound at first use; LRU-bounded to ``max_sessions`` ids per
    tenant (default 10,000); thread-safe."""

    def __init__(self, max_sessions: int = 10_000) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self._lock = threading.Lock()
        self._by_tenant: dict[str, OrderedDict[str, Session]] = {}

    def __len__(self) -> int:
        with self._lock:
            return sum(len(s) for s in self._by_tenant.values())

    @staticmethod
    def _check_id(session_id: str) -> None:
        if not session_id or len(session_id) > MAX_SESSION_ID:
            raise ValueError(f"a session id is 1 to {MAX_SESSION_ID} characters, got {len(session_id)}")

    def bind(self, tenant: str, session_id: str) -> Session:
        """The session ``session_id`` of ``tenant``, created now if unknown (implicit sessions:
        ``prompt_cache_key``). Raises ValueError (a bad id)."""
        self._check_id(session_id)
        with self._lock:
            own = self._by_tenant.setdefault(tenant, OrderedDict())
            s = own.get(session_id)
            if s is not None:
                own.move_to_end(session_id)
                return s
            s = own[session_id] = Session(session_id, tenant, int(time.time()))
            while len(own) > self.max_sessions:
                own.popitem(last=False)
            return s

    def create(self, tenant: str, session_id: str | None = None) -> Session:
        """A session for ``tenant``: a new random id, or ``session_id`` (the existing one when
        ``tenant`` already has it). Raises as ``bind``."""
        return self.bind(tenant, session_id if session_id is not None else f"sess_{secrets.token_hex(12)}")

    def get(self, tenant: str, session_id: str) -> Session:
        """The existing session ``session_id`` of ``tenant`` (explicit sessions). Raises
        SessionNotFoundError (``tenant`` has none by that id)."""
        with self._lock:
            own = self._by_tenant.get(tenant)
            s = own.get(session_id) if own is not None else None
            if s is None:
                raise SessionNotFoundError(f"unknown session {session_id[:MAX_SESSION_ID]!r}")
            own.move_to_end(session_id)
            return s
