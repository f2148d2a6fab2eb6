"""Suffix index over requests, tenant history and workspace documents (native core: next issue).

Until the core lands, ``agentspec.drafting.PromptLookupDrafter`` is the engine's default drafter.
"""

__all__: list[str] = []
