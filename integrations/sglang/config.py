"""What the front process tells SGLang's scheduler processes (torch-free, SGLang-free).

SGLang runs its scheduler (and with it the speculative worker that drafts) in processes of its
own, spawned by ``sglang.Engine``. The draft state therefore lives there: the suffix index, the
tenants' histories, the prediction documents of running requests and the workspace watchers.
The front process (``agentspec serve --backend sglang``) describes that state in a
``SchedulerConfig`` and puts it in the environment variable ``AGENTSPEC_SGLANG`` before it starts
the engine; every spawned SGLang process inherits it and the plugin's worker reads it.

Per request, the policy travels in SGLang's ``sampling_params["custom_params"]`` (flat keys:
SGLang allows only JSON scalars, lists of scalars or flat dicts there), built by
``request_params``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import msgspec

__all__ = ["ALGORITHM", "ENV", "KEY_BUDGET", "KEY_PREDICTION", "KEY_ROUTE", "KEY_SPEC", "KEY_TENANT",
           "SchedulerConfig", "TenantWorkspace", "read_request_params", "request_params"]

ALGORITHM = "AGENTSPEC"
"""The speculative algorithm name the plugin registers (``--speculative-algorithm AGENTSPEC``)."""
ENV = "AGENTSPEC_SGLANG"
"""The environment variable carrying the ``SchedulerConfig`` (JSON) into SGLang's processes."""

KEY_TENANT = "agentspec_tenant"
KEY_ROUTE = "agentspec_route"
KEY_SPEC = "agentspec_spec"            # False: speculation off (a root-only draft)
KEY_BUDGET = "agentspec_budget"        # max draft tokens (the verify width caps it)
KEY_PREDICTION = "agentspec_prediction"  # Predicted Outputs: token ids, a draft source for this request


class TenantWorkspace(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One tenant and the folder indexed for it (None: no workspace)."""

    name: str
    workspace: str | None = None


class SchedulerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The draft state of each SGLang scheduler process.

    ``tokenizer``: a folder with ``tokenizer.json`` (the model's), to tokenize workspace files.
    ``tenants``: whose workspaces to index and watch (every process that drafts indexes them).
    ``watch``: keep workspaces current with a file watcher. ``history``: record each tenant's
    outputs as a draft source for its later requests. ``default_budget``: draft tokens for a
    request that names none (the verify width caps every draft)."""

    tokenizer: str | None = None
    tenants: list[TenantWorkspace] = []
    watch: bool = True
    history: bool = True
    default_budget: int = 64

    def to_env(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_env(cls, environ: Any = None) -> "SchedulerConfig":
        raw = (os.environ if environ is None else environ).get(ENV)
        if not raw:
            return cls()
        return msgspec.json.decode(raw.encode(), type=cls)


def request_params(*, tenant: str = "default", route: str = "default", spec: bool = True,
                   budget: int | None = None, prediction: Sequence[int] | None = None) -> dict[str, Any]:
    """The ``custom_params`` entries that carry one request's draft policy into the scheduler."""
    out: dict[str, Any] = {KEY_TENANT: str(tenant), KEY_ROUTE: str(route), KEY_SPEC: bool(spec)}
    if budget is not None:
        out[KEY_BUDGET] = int(budget)
    if prediction:
        out[KEY_PREDICTION] = [int(t) for t in prediction]
    return out


def read_request_params(custom: Any) -> tuple[str, bool, int | None, list[int] | None]:
    """``(tenant, spec, budget, prediction)`` from a request's ``custom_params`` (None or foreign
    dicts: the defaults: tenant "default", speculation on)."""
    if not isinstance(custom, dict):
        return "default", True, None, None
    tenant = custom.get(KEY_TENANT)
    spec = custom.get(KEY_SPEC, True)
    budget = custom.get(KEY_BUDGET)
    pred = custom.get(KEY_PREDICTION)
    return (tenant if isinstance(tenant, str) and tenant else "default", spec is not False,
            budget if isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0 else None,
            [int(t) for t in pred] if isinstance(pred, list) and pred else None)
