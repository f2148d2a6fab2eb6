"""A mini-swe-agent ``Model`` on agentspec, so its agents run here by changing one line::

    from agentspec.sdk.minisweagent import AgentSpecModel
    agent = DefaultAgent(AgentSpecModel(base_url="http://127.0.0.1:8000"), env)   # was LitellmModel(...)

It satisfies mini-swe-agent's (1.x) ``Model`` protocol as ``LitellmModel`` does: ``query(messages,
**kwargs) -> {"content": str, "extra": {...}}``, the running ``cost`` and ``n_calls`` the agent's
limits read, ``config`` and ``get_template_vars()``. mini-swe-agent itself is not imported.
``cost`` is 0.0 per call unless ``cost_per_token`` is set (a local model costs nothing per token).
Messages keep ``role`` and ``content`` only (mini-swe-agent adds an ``extra`` field per message
that the server's strict schema would refuse). One agent run is one session: its id goes with
every call, so the server can keep the conversation's prefix warm.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .client import Client, new_session_id

__all__ = ["AgentSpecModel", "AgentSpecModelConfig"]


@dataclass
class AgentSpecModelConfig:
    model_name: str = ""                                     # "" : the server's model
    model_kwargs: dict[str, Any] = field(default_factory=dict)   # chat options for every call (temperature=0, ...)
    cost_per_token: float = 0.0                              # prompt + completion tokens -> ``cost``


class AgentSpecModel:
    """``client``: an ``agentspec.Client`` to use (not closed here); else one is made from
    ``base_url`` / ``api_key`` (None: the embedded engine in this process) and ``client_options``."""

    def __init__(self, client: Client | None = None, *, base_url: str | None = None, api_key: str | None = None,
                 model_name: str = "", model_kwargs: dict[str, Any] | None = None, cost_per_token: float = 0.0,
                 session_id: str | None = None, client_options: dict[str, Any] | None = None) -> None:
        self.config = AgentSpecModelConfig(model_name=model_name, model_kwargs=dict(model_kwargs or {}),
                                           cost_per_token=cost_per_token)
        self._own = client is None
        self.client = client if client is not None else Client(base_url, api_key=api_key, **(client_options or {}))
        self.session_id = session_id or new_session_id()
        self.cost = 0.0
        self.n_calls = 0

    def query(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        msgs = [{"role": m["role"], "content": m.get("content") or ""} for m in messages]
        result = self.client.chat(msgs, model=self.config.model_name or None, session_id=self.session_id,
                                  **{**self.config.model_kwargs, **kwargs})
        cost = self.config.cost_per_token * result.usage.total_tokens
        self.n_calls += 1
        self.cost += cost
        _add_global_cost(cost)
        return {"content": result.text,
                "extra": {"response": _plain(result), "cost": cost, "timestamp": time.time()}}

    def get_template_vars(self) -> dict[str, Any]:
        return asdict(self.config) | {"n_model_calls": self.n_calls, "model_cost": self.cost}

    def serialize(self) -> dict[str, Any]:
        return {"info": {"config": {"model": asdict(self.config),
                                    "model_type": f"{type(self).__module__}.{type(self).__name__}"}}}

    def close(self) -> None:
        if self._own:
            self.client.close()


def _plain(result: Any) -> dict[str, Any]:
    import msgspec

    return msgspec.to_builtins(result)


def _add_global_cost(cost: float) -> None:
    """mini-swe-agent's process-wide cost counter, when it is installed (its global limit reads it)."""
    try:
        from minisweagent.models import GLOBAL_MODEL_STATS  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - not installed, or a version without it
        return
    GLOBAL_MODEL_STATS.add(cost)
