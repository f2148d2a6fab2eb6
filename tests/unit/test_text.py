"""agentspec.text: stop strings and streaming detokenisation (no model needed)."""

from __future__ import annotations

import pytest

from agentspec.errors import InvalidRequestError
from agentspec.text import TextStream, check_stop, stop_index


class ByteTokenizer:
    """One token per UTF-8 byte: a multi-byte character spans tokens, as with real BPE."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_stop_index_is_the_earliest_stop():
    assert stop_index("abc END def STOP", ["STOP", "END"]) == 4
    assert stop_index("abc", ["x"]) == -1
    assert stop_index("abc", []) == -1
    assert stop_index("", ["a"]) == -1


def test_check_stop():
    assert check_stop(None) == []
    assert check_stop("x") == ["x"]
    assert check_stop(("a", "b")) == ["a", "b"]
    for bad, match in ((3, "string or a list"), (["a", 1], "string or a list"), ([""], "must not be empty"),
                       (["s"] * 17, "at most 16")):
        with pytest.raises(InvalidRequestError, match=match) as e:
            check_stop(bad)
        assert e.value.param == "stop"


@pytest.mark.parametrize("stops", [[], ["END"], ["你好"], ["é —"], ["here", "END"]])
def test_text_stream_sends_only_what_the_final_text_has(stops):
    tok = ByteTokenizer()
    text = "naïve café — ünïcödé 你好 and the END marker here"
    s = TextStream(tok, stops)
    pieces = [s.push([t]) for t in tok.encode(text)]
    sent = "".join(pieces)
    cut = stop_index(text, stops)
    final = text[:cut] if cut >= 0 else text
    assert final.startswith(sent) and "\ufffd" not in sent
    assert sent + s.finish(final) == final
    if not stops:
        assert sent == text  # nothing held back without stop strings


def test_text_stream_holds_back_a_possible_stop_prefix():
    tok = ByteTokenizer()
    s = TextStream(tok, ["STOP"])
    assert s.push(tok.encode("abcST")) == "ab"  # "ST" (and one more) may start "STOP"
    assert s.push(tok.encode("OP tail")) == "c"  # the stop string came: all before it, nothing past
    assert s.push(tok.encode(" more")) == ""
    assert s.finish("abc") == ""
