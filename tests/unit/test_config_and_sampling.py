from __future__ import annotations

import math

import pytest
import torch

from agentspec import ConfigError, SpecConfig
from agentspec.decode.verify import process_logits


def test_spec_config_defaults_and_validation():
    s = SpecConfig()
    assert s.budget == 32 and s.min_prob == 0.0
    with pytest.raises(ConfigError, match="budget must be an int >= 0, got -1"):
        SpecConfig(budget=-1)
    with pytest.raises(ConfigError, match="min_prob"):
        SpecConfig(min_prob=2.0)


def test_process_logits_is_the_softmax():
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    p = process_logits(logits, temperature=1.0, top_p=1.0, top_k=0)
    assert torch.allclose(p, torch.softmax(logits, -1), atol=1e-6)
    cooled = process_logits(logits, temperature=0.5, top_p=1.0, top_k=0)
    assert torch.allclose(cooled, torch.softmax(logits / 0.5, -1), atol=1e-6)


def test_process_logits_top_k_and_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    k2 = process_logits(logits, temperature=1.0, top_p=1.0, top_k=2)
    assert k2[2:].sum() == 0 and math.isclose(float(k2.sum()), 1.0, abs_tol=1e-6)
    p = torch.softmax(logits, -1)  # [0.64, 0.24, 0.09, 0.03]
    nucleus = process_logits(logits, temperature=1.0, top_p=0.8, top_k=0)  # smallest prefix reaching 0.8
    assert nucleus[2:].sum() == 0
    assert math.isclose(float(nucleus[0]), float(p[0] / (p[0] + p[1])), abs_tol=1e-6)
