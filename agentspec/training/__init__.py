"""Training draft heads for the embedded engine (``agentspec train-eagle3``).

``distill``: self-distilled data, the target's own responses to prompts; ``eagle3``: target
features and training-time-test training of an EAGLE-3 head in SGLang's checkpoint format.
"""
