"""The embedded engine's per-device speculation default (agentspec.backends.embedded.spec_device)."""

from __future__ import annotations

from agentspec.backends.embedded.spec_device import CUDA_REASON, OPT_IN_ENV, spec_off_reason


def test_cpu_speculates_by_default():
    assert spec_off_reason("cpu", deterministic=False, environ={}) is None
    assert spec_off_reason("cpu", deterministic=True, environ={}) is None


def test_cuda_is_off_by_default_with_the_reason():
    reason = spec_off_reason("cuda", deterministic=False, environ={})
    assert reason == CUDA_REASON
    assert "row-invariant" in reason and "deterministic=True" in reason and OPT_IN_ENV in reason


def test_cuda_deterministic_forwards_are_exact_so_it_speculates():
    assert spec_off_reason("cuda", deterministic=True, environ={}) is None


def test_cuda_opt_in_by_argument_or_environment():
    assert spec_off_reason("cuda", deterministic=False, opt_in=True, environ={}) is None
    assert spec_off_reason("cuda", deterministic=False, opt_in=False, environ={OPT_IN_ENV: "1"}) == CUDA_REASON
    for value in ("1", "true", "YES"):
        assert spec_off_reason("cuda", deterministic=False, environ={OPT_IN_ENV: value}) is None
    for value in ("0", "", "no"):
        assert spec_off_reason("cuda", deterministic=False, environ={OPT_IN_ENV: value}) == CUDA_REASON
