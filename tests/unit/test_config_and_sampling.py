from __future__ import annotations

import math

import pytest
import torch

from agentspec import ConfigError, SpecConfig
from agentspec.decode.verify import sample


def test_spec_config_defaults_and_validation():
    s = SpecConfig()
    assert s.budget == 32 and s.min_prob == 0.0
    with pytest.raises(ConfigError, match="budget must be an int >= 0, got -1"):
        SpecConfig(budget=-1)
    with pytest.raises(ConfigError, match="min_prob"):
        SpecConfig(min_prob=2.0)


def _freq(logits, n=4000, **kw):
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(logits.shape[0])
    for _ in range(n):
        counts[sample(logits, kw.get("temperature", 1.0), kw.get("top_p", 1.0), kw.get("top_k", 0), g)] += 1
    return counts / n


def test_sample_follows_softmax():
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    f = _freq(logits)
    p = torch.softmax(logits, -1)
    assert torch.allclose(f, p, atol=0.03)


def test_sample_top_k_and_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert _freq(logits, n=500, top_k=2)[2:].sum() == 0
    p = torch.softmax(logits, -1)  # [0.64, 0.24, 0.09, 0.03]
    f = _freq(logits, n=2000, top_p=0.8)  # smallest prefix reaching 0.8: tokens 0 and 1
    assert f[2:].sum() == 0
    assert math.isclose(f[0].item(), (p[0] / (p[0] + p[1])).item(), abs_tol=0.04)


def test_sample_seed_repeats():
    logits = torch.randn(100)
    a = [sample(logits, 0.9, 1.0, 0, g) for g in [torch.Generator().manual_seed(7)] for _ in range(20)]
    b = [sample(logits, 0.9, 1.0, 0, g) for g in [torch.Generator().manual_seed(7)] for _ in range(20)]
    assert a == b
