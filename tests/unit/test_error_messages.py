"""Unknown keys name themselves and list what their table (config) or object (HTTP body) takes."""

from __future__ import annotations

import msgspec
import pytest

from agentspec.api.protocol import (
    APIError,
    ApplyRequest,
    ChatCompletionRequest,
    CompletionRequest,
    SessionCreateRequest,
    decode_body,
)
from agentspec.config import RouteRule, RouteWhen, ServerConfig, ServerSection, TenantConfig, load_server_config
from agentspec.errors import ConfigError


def keys(struct) -> list[str]:
    return [f.encode_name for f in msgspec.structs.fields(struct)]


# (TOML, the unknown key, where the message says it is, the table's struct, a suggestion or None)
CONFIGS = [
    ('serverr = 1\n', "serverr", "at the top level", ServerConfig, "server"),
    ('[server]\nlog_dirr = "x"\n', "log_dirr", "in [server]", ServerSection, "log_dir"),
    ('[[tenants]]\nname = "a"\n[[tenants]]\nname = "b"\napi_key = ["sk-0123456789"]\n', "api_key",
     "in tenants[1]", TenantConfig, "api_keys"),
    ('[[routes]]\nname = "r"\nbugdet = 4\n', "bugdet", "in routes[0]", RouteRule, "budget"),
    ('[[routes]]\nname = "r"\n[routes.when]\nendpoints = "apply"\n', "endpoints", "in routes[0].when", RouteWhen,
     "endpoint"),
    ('[[routes]]\nname = "r"\nwhen = { zzz = 1 }\n', "zzz", "in routes[0].when", RouteWhen, None),
]


@pytest.mark.parametrize("toml,key,where,struct,suggestion", CONFIGS)
def test_unknown_config_key_names_it_and_lists_its_tables_keys(tmp_path, toml, key, where, struct, suggestion):
    path = tmp_path / "agentspec.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_server_config(path)
    msg = str(info.value)
    assert f"unknown key `{key}` {where};" in msg, msg
    assert msg.endswith("valid keys: " + ", ".join(keys(struct))), msg
    assert (f"did you mean `{suggestion}`?" in msg) if suggestion else "did you mean" not in msg, msg
    assert str(path) in msg


def test_other_config_errors_keep_naming_the_field(tmp_path):
    path = tmp_path / "agentspec.toml"
    path.write_text('[server]\nmax_queue = "many"\n')
    with pytest.raises(ConfigError, match=r"Expected `int`, got `str` - at `\$.server.max_queue`"):
        load_server_config(path)


# (body type, JSON body, param, the object's struct, where the message says it is)
BODIES = [
    (ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "a"}], "max_token": 3}', "max_token",
     ChatCompletionRequest, "the request body"),
    (ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "a", "nmae": "x"}]}', "messages[0].nmae",
     "Message", "`messages[0]`"),
    (ChatCompletionRequest, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]}',
     "messages[0].content[0].x", "ContentPart", "`messages[0].content[0]`"),
    (ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "a"}], "stream_options": {"usage": true}}',
     "stream_options.usage", "StreamOptions", "`stream_options`"),
    (CompletionRequest, b'{"prompt": "a", "max_tokns": 3}', "max_tokns", CompletionRequest, "the request body"),
    (ApplyRequest, b'{"code": "a", "updates": "b"}', "updates", ApplyRequest, "the request body"),
    (SessionCreateRequest, b'{"name": "s"}', "name", SessionCreateRequest, "the request body"),
]


@pytest.mark.parametrize("body_type,body,param,struct,where", BODIES)
def test_unknown_body_field_is_a_400_naming_it_and_listing_the_valid_fields(body_type, body, param, struct, where):
    import agentspec.api.protocol as protocol

    struct = getattr(protocol, struct) if isinstance(struct, str) else struct
    with pytest.raises(APIError) as info:
        decode_body(body, body_type)
    e = info.value
    assert (e.status, e.param, e.code, e.type) == (400, param, "unknown_field", "invalid_request_error")
    name = param.rsplit(".", 1)[-1]
    assert e.message.startswith(f"unknown field `{name}` in {where};"), e.message
    assert e.message.endswith("valid fields: " + ", ".join(keys(struct))), e.message
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}


def test_openai_options_not_implemented_are_unsupported_not_unknown():
    for field, value in (("functions", "[]"), ("function_call", '"auto"'), ("logit_bias", '{"1": 2}')):
        with pytest.raises(APIError) as info:
            decode_body(b'{"messages": [{"role": "user", "content": "a"}], "%s": %s}' % (field.encode(), value.encode()),
                        ChatCompletionRequest)
        e = info.value
        assert (e.status, e.param, e.code) == (400, field, "unsupported_parameter"), e.body()
        assert f"`{field}` is not supported" in e.message


def test_openai_fields_that_were_accepted_still_are():
    body = (b'{"messages": [{"role": "user", "content": "a"}], "user": "u", "metadata": {"k": "v"}, "store": false,'
            b' "service_tier": "auto", "prompt_cache_key": "s", "parallel_tool_calls": false, "top_logprobs": null,'
            b' "max_completion_tokens": 4, "stream_options": {"include_usage": true}, "seed": 1, "stop": ["x"],'
            b' "presence_penalty": 0, "frequency_penalty": 0, "logprobs": false, "n": 1, "stream": true}')
    req = decode_body(body, ChatCompletionRequest)
    req.check_unsupported()
    assert req.max_completion_tokens == 4 and req.user == "u"
