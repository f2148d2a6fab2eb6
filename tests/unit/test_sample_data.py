"""The data shipped in benchmarks/data (what the benchmarks and some tests read by default):
the recorded rewrite sample is held out and attributed; the synthetic agent turns have the
recorded traffic's shape, and their generator writes them the same way every time."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from agentspec.traces import conversation_turns, load_records, prompt_messages

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "benchmarks" / "data"
_spec = importlib.util.spec_from_file_location("make_agent_turns", DATA / "make_agent_turns.py")
gen = importlib.util.module_from_spec(_spec)
sys.modules["make_agent_turns"] = gen
_spec.loader.exec_module(gen)

ONE_BASH_BLOCK = re.compile(r"\ATHOUGHT: .+\n\n```bash\n[^`]+\n```\Z", re.S)


def check_agent_turns(recs: list[dict]) -> None:
    """The recorded agent turns' shape: the four fields; a prompt of <|role|> blocks ending in an
    open assistant turn, starting with the system message; a response of reasoning and one bash
    command; each trajectory's records in turn order, each prompt extending the one before."""
    assert recs
    last: dict[str, str] = {}
    for r in recs:
        assert set(r) == {"id", "source", "prompt", "response"}, r["id"]
        assert r["prompt"].startswith("<|system|>\n") and r["prompt"].endswith("<|assistant|>\n"), r["id"]
        msgs = prompt_messages(r["prompt"])
        assert [m["role"] for m in msgs[:2]] == ["system", "user"] and msgs[-1]["role"] == "user", r["id"]
        assert ONE_BASH_BLOCK.match(r["response"]), r["response"]
        task, turn = r["id"].split("#t")
        assert len(conversation_turns(msgs)) == int(turn), r["id"]
        if task in last:   # the next turn: the history so far, then this turn's reply
            assert r["prompt"].startswith(last[task]), r["id"]
        last[task] = r["prompt"][:-len("<|assistant|>\n")]


def test_shipped_agent_turns_have_the_recorded_shape():
    recs = list(load_records(DATA / "agent_turns.jsonl"))
    check_agent_turns(recs)
    assert all(r["source"].startswith("synthetic") for r in recs)
    # what the benchmarks' conversations and the prefix-cache test need: trajectories of >= 4 turns
    first = {}
    for r in recs:
        first.setdefault(r["id"].split("#")[0], r)
    assert len(first) >= 3 and all(len(conversation_turns(prompt_messages(r["prompt"]))) >= 4 for r in first.values())


@pytest.mark.extended   # (benchmark tooling, seconds: the extended tier)
def test_generator_is_deterministic_and_echoes_the_files():
    files = gen.python_files()
    a, b = gen.records(files), gen.records(dict(files))
    assert a == b
    check_agent_turns(a)
    # a turn that reads a definition shows the file's own lines, numbered as `nl -ba` does
    shown = 0
    for r in a:
        for m in re.finditer(r"nl -ba (\S+) \| sed -n '(\d+),(\d+)p'\n```\n<\|user\|>\n<returncode>0</returncode>\n"
                             r"<output>\n(.*?)\n</output>", r["prompt"], re.S):
            path, lo, hi, out = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
            lines = files[path].splitlines()
            assert out == "\n".join(f"{i:6d}\t{lines[i - 1]}" for i in range(lo, min(hi, len(lines)) + 1))
            shown += 1
    assert shown > 0


def test_rewrite_sample_is_held_out_and_attributed():
    recs = list(load_records(DATA / "file_rewrites.jsonl"))
    tests_own = {r["id"] for r in load_records(ROOT / "tests" / "fixtures" / "file_rewrites_sample.jsonl")}
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids)) and not set(ids) & tests_own
    readme = (DATA / "README.md").read_text()
    listed = re.findall(r"^- `(aider/[^`]+)`$", readme, re.M)
    assert listed == ids and "Aider-AI/aider" in readme and "Apache-2.0" in readme
    for r in recs:
        assert set(r) == {"id", "source", "prompt", "response"}
        assert r["prompt"].endswith("<|assistant|>\n") and prompt_messages(r["prompt"])
