"""The SGLang plugin entry point (``[project.entry-points."sglang.srt.plugins"] agentspec``).

SGLang calls ``load()`` early in each of its processes (engine, scheduler, detokenizer, data
parallel controller). It registers two speculative algorithms under their own names (SGLang's
NGRAM and EAGLE3 stay as they are):

- ``AGENTSPEC`` (``--speculative-algorithm AGENTSPEC``): NGRAM's tree verifier drafting from the
  suffix index (``worker.AgentSpecWorker``);
- ``AGENTSPEC_EAGLE3`` (with ``--speculative-draft-model-path HEAD``): SGLang's EAGLE-3 worker
  whose steps verify the suffix index's draft where it expects more than the head's
  (``hybrid.AgentSpecEagle3Worker``). It runs with overlap scheduling off.

SGLang logs and swallows an exception raised here, so a failure would only show as "Unknown
speculative algorithm name: AGENTSPEC" later; ``load`` therefore logs what failed itself.
"""

from __future__ import annotations

import logging

from .config import ALGORITHM, HYBRID_ALGORITHM

logger = logging.getLogger(__name__)

_registered = False


def spec_class(base: str = "NGRAM"):
    """``CustomSpecAlgo`` answering every question SGLang asks of an algorithm (``is_ngram()``,
    ``is_eagle3()``, ``has_draft_kv()``, ``handle_server_args``, ...) as its ``base`` does:
    AGENTSPEC is NGRAM's draft-model-free tree verifier with other drafts, AGENTSPEC_EAGLE3 is
    EAGLE3 with other drafts on some steps, so the scheduler, memory planning, the target's
    hidden-state capture and server-argument handling must treat them as their base. Only
    ``create_worker`` differs. Forwarding every method of the enum (rather than overriding a
    list) keeps this right when a SGLang release adds one."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    ngram = getattr(SpeculativeAlgorithm, base)

    def forward(name):
        def method(self, *args, **kwargs):
            return getattr(ngram, name)(*args, **kwargs)

        method.__name__ = name
        return method

    own = {"create_worker"}
    namespace = {name: forward(name) for name, value in vars(SpeculativeAlgorithm).items()
                 if not name.startswith("_") and name not in own and callable(value)
                 and not isinstance(value, (classmethod, staticmethod))}
    return type(f"AgentSpec{base.title()}Algo", (CustomSpecAlgo,), namespace)


def load() -> None:
    """Register ``AGENTSPEC`` and ``AGENTSPEC_EAGLE3`` with SGLang (idempotent)."""
    global _registered
    if _registered:
        return
    try:
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        from sglang.srt.speculative.spec_registry import get_spec

        if get_spec(ALGORITHM) is None:
            @SpeculativeAlgorithm.register(ALGORITHM, supports_overlap=True, spec_class=spec_class())
            def _factory(server_args):
                from .worker import AgentSpecWorker

                return AgentSpecWorker
        if get_spec(HYBRID_ALGORITHM) is None:
            # supports_overlap=False: its drafts read committed tokens from req.output_ids, which
            # lag one step under overlap scheduling (SGLang refuses the start unless it is off)
            @SpeculativeAlgorithm.register(HYBRID_ALGORITHM, supports_overlap=False, spec_class=spec_class("EAGLE3"))
            def _hybrid_factory(server_args):
                from .hybrid import AgentSpecEagle3Worker

                return AgentSpecEagle3Worker
        _registered = True
    except Exception:
        logger.exception("agentspec: could not register the %s / %s speculative algorithms with SGLang", ALGORITHM,
                         HYBRID_ALGORITHM)
        raise
