"""Integrations (installed as ``agentspec.integrations``): the SGLang plugin and the editor server land here."""
