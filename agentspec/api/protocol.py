"""HTTP bodies of the OpenAI-compatible API, as msgspec Structs.

Requests are decoded strictly: a field we do not know is a 400 naming it and listing the fields
that object takes (a typo such as ``max_token`` must not be silently ignored), and features we do
not implement (tools, logprobs, penalties, n > 1) are refused by name rather than ignored.
Extensions are marked as such.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from ..backends.protocol import GREEDY_BELOW, MAX_TEMPERATURE
from ..config import unknown_field

__all__ = ["GREEDY_BELOW", "APIError", "ApplyRequest", "ChatCompletionRequest", "CompletionRequest",
           "SessionCreateRequest", "check_parts", "error_body", "sampling_temperature"]


class APIError(Exception):
    """An error with an HTTP status and the OpenAI error envelope."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    def check_unsupported(self) -> None:
        """Refuse, by name, options that decode fine but are not implemented (none here)."""


class ContentPart(_Strict):
    type: Literal["text", "image_url", "input_audio", "file", "refusal"]
    text: str | None = None
    image_url: Any = None        # refused by name (check_parts): the models served read text only
    input_audio: Any = None
    file: Any = None
    refusal: str | None = None


class FunctionCallParam(_Strict):
    name: str
    arguments: str = ""          # a JSON object, as a string (OpenAI's shape)


class ToolCallParam(_Strict):
    id: str
    function: FunctionCallParam
    type: Literal["function"] = "function"


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None   # an assistant turn's calls
    tool_call_id: str | None = None                 # a tool result: the call it answers
    refusal: str | None = None                      # echoed back by some clients; null only
    reasoning_content: str | None = None            # an assistant turn's thoughts (DeepSeek, vLLM, llama.cpp)
    reasoning: str | None = None                    # ... as OpenRouter and newer vLLM name them


ToolName = Annotated[str, msgspec.Meta(pattern=r"^[a-zA-Z0-9_.\-]{1,128}$")]


class FunctionDef(_Strict):
    name: ToolName
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolParam(_Strict):
    type: Literal["function", "custom"]
    function: FunctionDef | None = None
    custom: Any = None           # refused by name (a freeform tool)


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str
    schema: dict | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Prediction(_Strict):
    # OpenAI Predicted Outputs: text the completion is expected to repeat largely unchanged
    type: Literal["content"]
    content: str | list[ContentPart]


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM's usage on every chunk: not implemented, refused when true




def sampling_temperature(t: float) -> float:
    """``t`` as sampled: 0.0 (greedy) for ``t < GREEDY_BELOW``, else ``t``."""
    return 0.0 if t < GREEDY_BELOW else t


NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
SessionId = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]   # sessions.MAX_SESSION_ID
RouteName = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]    # config.Name: a configured route
Stop = str | list[str] | None


class _Sampling(_Strict):
    model: str | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1)] | None = None      # extension (vLLM): -1/0 = off
    seed: int | None = None
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, msgspec.Meta(ge=1)] = 1
    user: str | None = None
    prediction: Prediction | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | int | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None           # session id (cache affinity across an agent loop)
    session: SessionId | None = None              # extension: an existing session's id (api/sessions.py)
    spec_stats: bool = False                      # extension: speculation stats in the response
    speculation: bool | None = None               # extension: false turns speculation off for this request
    route: RouteName | None = None                # extension: a configured route, by name (not by its `when`)

    def check_unsupported(self) -> None:
        if self.n != 1:
            raise APIError(400, f"n must be 1 (several choices per request are not supported), got {self.n}",
                           param="n", code="unsupported_parameter")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if v not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported (got {v})", param=name, code="unsupported_parameter")
        # chat: a boolean; completions: how many top tokens per position, where 0 still asks for the
        # sampled token's logprob. Only "none" (absent, null, false) is honoured: logprobs are not computed
        if self.logprobs is not None and self.logprobs is not False:
            raise APIError(400, f"logprobs are not supported (got {self.logprobs!r}; leave it out or send null)",
                           param="logprobs", code="unsupported_parameter")
        so = self.stream_options
        if so is not None:
            if not self.stream:   # OpenAI refuses it too: the options shape a stream
                raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options",
                               code="invalid_value")
            if so.continuous_usage_stats:
                raise APIError(400, "stream_options.continuous_usage_stats (usage on every chunk) is not "
                                    "supported; use include_usage for one usage chunk at the end",
                               param="stream_options.continuous_usage_stats", code="unsupported_parameter")


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    top_logprobs: int | None = None
    parallel_tool_calls: bool | None = None
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    # a thinking model (Qwen3, QwQ, R1): "none" turns its thoughts off, any other effort leaves them to the
    # template; a hint for a model that does not think
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None   # extension (vLLM, SGLang, llama.cpp): enable_thinking

    def check_unsupported(self) -> None:
        super().check_unsupported()
        for i, m in enumerate(self.messages):
            if m.refusal is not None:
                raise APIError(400, f"messages[{i}].refusal is not supported (send the text as content)",
                               param=f"messages[{i}].refusal", code="unsupported_parameter")
            if isinstance(m.content, list):
                check_parts(m.content, f"messages[{i}].content")
        for i, t in enumerate(self.tools or ()):
            if t.type != "function" or t.function is None:
                raise APIError(400, f"tools[{i}]: only function tools are supported, got type {t.type!r} (a "
                                    "freeform custom tool needs a grammar of its own)", param=f"tools[{i}].type",
                               code="unsupported_parameter")
        for k, v in (self.chat_template_kwargs or {}).items():
            if k != "enable_thinking":
                raise APIError(400, f"chat_template_kwargs.{k} is not supported (only enable_thinking is passed to "
                                    "the chat template)", param=f"chat_template_kwargs.{k}",
                               code="unsupported_parameter")
            if not isinstance(v, bool):
                raise APIError(400, f"chat_template_kwargs.enable_thinking must be true or false, got {v!r}",
                               param="chat_template_kwargs.enable_thinking", code="invalid_value")
        if self.top_logprobs not in (None, 0):
            raise APIError(400, f"top_logprobs is not supported (logprobs are not computed), got {self.top_logprobs}",
                           param="top_logprobs", code="unsupported_parameter")


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[Any]   # text, token ids, or a batch of one of either (checked in the handler)
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 16   # OpenAI's default for completions
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo", code="unsupported_parameter")
        if self.suffix:
            raise APIError(400, "suffix (insertion) is not supported", param="suffix", code="unsupported_parameter")
        if self.best_of not in (None, 1):
            raise APIError(400, f"best_of must be 1, got {self.best_of}", param="best_of", code="unsupported_parameter")


class ApplyRequest(_Strict, kw_only=True):
    """Fast apply: merge ``update`` (an edit snippet) or ``instruction`` into ``code`` (or the
    workspace file at ``path``); the original code is the draft source."""

    code: str | None = None
    path: str | None = None
    update: str | None = None
    instruction: str | None = None
    stream: bool = False
    model: str | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=MAX_TEMPERATURE)] = 0.0
    seed: int | None = None
    speculation: bool | None = None
    prompt_cache_key: str | None = None
    session: SessionId | None = None              # extension: an existing session's id (api/sessions.py)
    route: RouteName | None = None                # extension: a configured route, by name (not by its `when`)


class SessionCreateRequest(_Strict, kw_only=True):
    """``POST /v1/sessions`` (extension): an optional id of the caller's choosing."""

    id: SessionId | None = None


# OpenAI request fields this server does not implement: refused by name as unsupported, not as
# unknown (what the OpenAI API takes and is implemented here is a field of the structs above)
OPENAI_UNSUPPORTED = frozenset({
    "audio", "function_call", "functions", "logit_bias", "modalities", "safety_identifier", "verbosity",
    "web_search_options",
})


def check_parts(parts: list[ContentPart], where: str) -> None:
    """Text parts only: an image, audio or file part is refused by name (the models served read text)."""
    for j, part in enumerate(parts):
        if part.type != "text":
            raise APIError(400, f"{where}[{j}] is a {part.type!r} part: this server's model reads text only; "
                                "send text parts", param=f"{where}[{j}].type", code="unsupported_content")
        if part.text is None:
            raise APIError(400, f"{where}[{j}] needs `text`", param=f"{where}[{j}].text", code="invalid_value")


def decode_body(body: bytes, type: Any) -> Any:
    """Decode a JSON body into ``type``; errors become 400s naming the field (``param``: its path,
    ``messages[0].foo``); an unknown field's message lists the fields its object takes."""
    try:
        return msgspec.json.decode(body, type=type)
    except msgspec.ValidationError as e:
        msg = str(e)
        bad = unknown_field(e, type)
        if bad is not None:
            if not bad.where and bad.name in OPENAI_UNSUPPORTED:
                return _raise(400, f"`{bad.name}` is not supported by this server (an OpenAI option it does not "
                                   f"implement): remove it from the request", bad.name, "unsupported_parameter")
            where = f"`{bad.where}`" if bad.where else "the request body"
            return _raise(400, f"unknown field `{bad.name}` in {where}; {bad.hint('fields')}",
                          bad.path, "unknown_field")
        param = None
        if "at `$." in msg:
            path = msg.rsplit("at `$.", 1)[1].rstrip("`")
            param = path.split("[")[0].split(".")[0] or None
        if "unknown field" in msg:   # an object the walk above could not place: msgspec's own words
            return _raise(400, f"unknown field: {msg}", param, "unknown_field")
        return _raise(400, f"invalid request: {msg}", param, "invalid_value")
    except msgspec.DecodeError as e:
        return _raise(400, f"request body is not valid JSON: {e}", None, "invalid_json")
    except RecursionError:   # a body nested thousands of levels deep (a `prompt` of lists of lists ...)
        return _raise(400, "request body is nested too deeply", None, "invalid_json")
    except (ValueError, TypeError, OverflowError) as e:   # any other decoder refusal is the body's fault too
        return _raise(400, f"invalid request body: {type_name(e)}: {e}", None, "invalid_json")


def type_name(e: BaseException) -> str:
    return type(e).__name__


def _raise(status: int, message: str, param: str | None, code: str):
    raise APIError(status, message, param=param, code=code)
