"""agentspec inside SGLang (installed as ``agentspec.integrations.sglang``; extra ``[sglang]``).

- ``plugin``: the entry point SGLang loads in each of its processes (group ``sglang.srt.plugins``);
  it registers the speculative algorithm ``AGENTSPEC``.
- ``worker``: ``AgentSpecWorker``, SGLang's NGRAM worker drafting from agentspec's suffix index
  (whole prompts, tenant histories, workspace documents, Predicted Outputs) instead of NGRAM's
  18-token window. Lives in SGLang's scheduler process.
- ``config``: what the front process tells the scheduler processes (``SchedulerConfig`` in
  ``$AGENTSPEC_SGLANG``) and the per-request ``custom_params`` keys. SGLang-free.

The server in front (``agentspec serve --backend sglang``) is ``agentspec.integrations.sglang.backend``.
Importing this package imports neither SGLang nor torch.
"""

from .config import ALGORITHM, ENV, SchedulerConfig, TenantWorkspace, request_params

__all__ = ["ALGORITHM", "ENV", "SchedulerConfig", "TenantWorkspace", "request_params"]
