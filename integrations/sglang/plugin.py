"""The SGLang plugin entry point (``[project.entry-points."sglang.srt.plugins"] agentspec``).

SGLang calls ``load()`` early in each of its processes (engine, scheduler, detokenizer, data
parallel controller). It registers the speculative algorithm ``AGENTSPEC``
(``--speculative-algorithm AGENTSPEC``) under its own name; SGLang's NGRAM stays as it is.

SGLang logs and swallows an exception raised here, so a failure would only show as "Unknown
speculative algorithm name: AGENTSPEC" later; ``load`` therefore logs what failed itself.
"""

from __future__ import annotations

import logging

from .config import ALGORITHM

logger = logging.getLogger(__name__)

_registered = False


def spec_class():
    """``CustomSpecAlgo`` for AGENTSPEC, answering every question SGLang asks of an algorithm
    (``is_ngram()``, ``has_draft_kv()``, ``carries_draft_hidden_states()``, ``create_future_map``,
    ...) as its NGRAM does: AGENTSPEC is NGRAM's draft-model-free tree verifier with other drafts,
    so the scheduler, memory planning, overlap relay and server-argument handling must treat it
    as NGRAM. Only ``create_worker`` differs. Forwarding every method of the enum (rather than
    overriding a list) keeps this right when a SGLang release adds one."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    ngram = SpeculativeAlgorithm.NGRAM

    def forward(name):
        def method(self, *args, **kwargs):
            return getattr(ngram, name)(*args, **kwargs)

        method.__name__ = name
        return method

    own = {"create_worker"}
    namespace = {name: forward(name) for name, value in vars(SpeculativeAlgorithm).items()
                 if not name.startswith("_") and name not in own and callable(value)
                 and not isinstance(value, (classmethod, staticmethod))}
    return type("AgentSpecAlgo", (CustomSpecAlgo,), namespace)


def load() -> None:
    """Register ``AGENTSPEC`` with SGLang (idempotent)."""
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
        _registered = True
    except Exception:
        logger.exception("agentspec: could not register the %s speculative algorithm with SGLang", ALGORITHM)
        raise
