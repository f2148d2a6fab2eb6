"""``--backend sglang`` refuses the ``[server]`` keys it cannot honour instead of ignoring them."""

from __future__ import annotations

import pytest

from agentspec import ConfigError
from agentspec.api.state import SGLANG_REFUSED, build_state, check_sglang_config
from agentspec.config import ServerConfig, ServerSection


def test_defaults_pass():
    check_sglang_config(ServerConfig())
    # keys SGLang's backend does honour (limits, logs) may be set
    check_sglang_config(ServerConfig(server=ServerSection(default_max_tokens=512, max_queue=8)))


@pytest.mark.parametrize("key,value", [("model", "some/model.gguf"), ("max_batch", 4),
                                       ("budget_policy", "fixed"), ("prefix_cache_bytes", 1 << 20),
                                       ("prefix_cache_shared", True)])
def test_each_key_it_cannot_honour_is_refused_by_name(key, value):
    with pytest.raises(ConfigError) as e:
        check_sglang_config(ServerConfig(server=ServerSection(**{key: value})))
    msg = str(e.value)
    assert f"{key} = {value!r}" in msg and "--backend sglang" in msg and SGLANG_REFUSED[key] in msg


def test_every_refused_key_is_one_of_the_servers():
    assert set(SGLANG_REFUSED) <= set(ServerSection.__struct_fields__)


def test_build_state_refuses_before_starting_sglang():
    # the check runs before any engine starts (SGLang need not be installed for the refusal)
    with pytest.raises(ConfigError, match="max_batch = 4"):
        build_state(ServerConfig(server=ServerSection(max_batch=4)), backend="sglang",
                    sglang_options={"model": "unused"})
