"""The figures the user-facing docs quote come from results files that are in the repository.

Documents checked: README.md, docs/*.md and benchmarks/**/*.md. The rules:

- **Citations.** Every ``benchmarks/results/...`` path a document names (in a code span, a link or
  prose) is a file or folder of the repository.
- **Headline figures.** For a curated list of headline figures (``FIGURES``: the document, the
  text that quotes the figure, the figure as written, its results file and where in the JSON), the
  document still quotes the figure and cites the file, and the file holds a value that rounds,
  half up at the figure's precision, to it (a key path of None: any number in the file will do).
  A range (``RANGES``: "1.7-1.9x") is checked at both ends against the values it summarises.

When a new run replaces a figure, update the entry here with the docs. Each check is shown to fail
on a planted wrong figure (the negative tests at the end).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DOC_GLOBS = ("README.md", "docs/*.md", "benchmarks/**/*.md")
CITED = re.compile(r"benchmarks/results/[A-Za-z0-9_.+/-]*[A-Za-z0-9_]")


def documents() -> list[Path]:
    return sorted({p for g in DOC_GLOBS for p in ROOT.glob(g) if p.is_file() and "node_modules" not in p.parts})


DOCS = documents()
DOC_IDS = [str(p.relative_to(ROOT)) for p in DOCS]


def flat(text: str) -> str:
    """Whitespace (line breaks included) as single spaces: a quote may wrap anywhere."""
    return re.sub(r"\s+", " ", text)


@cache
def doc_text(doc: str) -> str:
    return (ROOT / doc).read_text(encoding="utf-8")


@cache
def results(name: str):
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def numbers(x) -> Iterator[float]:
    if isinstance(x, dict):
        for v in x.values():
            yield from numbers(v)
    elif isinstance(x, list):
        for v in x:
            yield from numbers(v)
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield x


def rounds_to(value: float, written: str) -> bool:
    """``value`` rounded half up at the precision of ``written`` ("190.2", "5,267") equals it."""
    want = Decimal(written.replace(",", ""))
    step = Decimal(1).scaleb(want.as_tuple().exponent)
    return Decimal(repr(value)).quantize(step, rounding=ROUND_HALF_UP) == want


# ---------------------------------------------------------------------------------------------
# Citations


def check_citations(text: str) -> list[str]:
    return [f"cites {m[0]}, which does not exist" for m in CITED.finditer(text) if not (ROOT / m[0]).exists()]


@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_cited_results_files_exist(doc: Path):
    assert check_citations(doc.read_text(encoding="utf-8")) == []


# ---------------------------------------------------------------------------------------------
# Headline figures


@dataclass(frozen=True)
class Figure:
    doc: str                       # the document, relative to the repository root
    quote: str                     # the text around the figure, as the document has it
    number: str                    # the figure as written (within ``quote``)
    file: str                      # relative to benchmarks/results/
    path: tuple[str, ...] | None   # where the value is in the JSON; None: anywhere


# where a sessions / turns results file keeps its ratios
VS_BEST = ("summary", "agentspec_spec_vs_llama_best", "ratio")    # ours speculating / llama-server's best
VS_PLAIN = ("summary", "agentspec:spec", "vs_agentspec_plain")     # ours speculating / ours plain
PLAIN_VS_LLAMA = ("summary", "agentspec_plain_vs_llama_plain")    # ours plain / llama-server plain


def ratios(doc: str, quote: str, vs_best: str, vs_plain: str, file: str) -> tuple[Figure, Figure]:
    """A quote giving both ratios of one run ("2.240x and 1.241x"): against llama-server's best
    configuration and against our own plain decoding."""
    return Figure(doc, quote, vs_best, file, VS_BEST), Figure(doc, quote, vs_plain, file, VS_PLAIN)


FIGURES = [
    Figure("README.md", "speculation 2.321x its best configuration", "2.321",
           "gguf_sessions_1.5b_2026-12-07h.json", VS_BEST),
    Figure("README.md", "and 1.175x our plain decoding, time to a turn's", "1.175",
           "gguf_sessions_1.5b_2026-12-07h.json", VS_PLAIN),
    Figure("docs/benchmarks.md", "Speculation ran at **2.321x** llama-server's best", "2.321",
           "gguf_sessions_1.5b_2026-12-07h.json", VS_BEST),
    Figure("docs/benchmarks.md", "**1.175x** our own plain decoding", "1.175",
           "gguf_sessions_1.5b_2026-12-07h.json", VS_PLAIN),
    Figure("docs/benchmarks.md", "our plain decoding at 1.975x llama-server's", "1.975",
           "gguf_sessions_1.5b_2026-12-07h.json", PLAIN_VS_LLAMA),
    *ratios("docs/benchmarks.md", "2026-12-07e.json`, gave 2.240x and 1.241x", "2.240", "1.241",
            "gguf_sessions_1.5b_2026-12-07e.json"),
    *ratios("docs/benchmarks.md", "float32 KV cache) gave 2.017x and 1.175x", "2.017", "1.175",
            "gguf_sessions_1.5b_2026-12-07d.json"),
    *ratios("docs/benchmarks.md", "**1.940x** its best configuration and 1.212x our plain", "1.940", "1.212",
            "gguf_turns_qwen2.5-coder-1.5b_2026-12-07c.json"),
    *ratios("docs/benchmarks.md", "2026-12-07b.json`: 1.979x and 1.177x", "1.979", "1.177",
            "gguf_turns_qwen2.5-coder-1.5b_2026-12-07b.json"),
    Figure("docs/design.md", "0.156 ms a layer against 0.255", "0.156", "dot_attention_1.5b_2026-12-07.json", None),
    Figure("docs/design.md", "0.156 ms a layer against 0.255", "0.255", "dot_attention_1.5b_2026-12-07.json", None),
    Figure("docs/design.md", "0.855 ms against 1.568", "0.855", "dot_attention_1.5b_2026-12-07.json", None),
    Figure("docs/design.md", "0.855 ms against 1.568", "1.568", "dot_attention_1.5b_2026-12-07.json", None),
    Figure("docs/design.md", "0.778 against 1.579", "0.778", "dot_attention_1.5b_2026-12-07.json", None),
    Figure("docs/design.md", "4.818 against 8.107", "8.107", "dot_attention_1.5b_2026-12-07.json", None),
    Figure("docs/benchmarks.md", "36.2, 41.3,\n52.7 and 84.3 ms", "84.3", "verify_step_1.5b_2026-12-07b.json", None),
    Figure("docs/benchmarks.md", "of which attention 7.5, 10.6, 16.1 and 27.5", "27.5", "verify_step_1.5b_2026-12-07b.json",
           None),
    Figure("docs/design.md", "(306 against 139 GFLOP/s", "306", "prefill_native_1.5b_2026-12-07.json", None),
    Figure("docs/design.md", "against 139 GFLOP/s", "139", "prefill_native_1.5b_2026-12-07.json", None),
    Figure("docs/benchmarks.md", "**26.28 ms** (306 GFLOP/s)", "26.28", "prefill_native_1.5b_2026-12-07.json", None),
    Figure("docs/benchmarks.md", "58.09 ms (139 GFLOP/s)", "58.09", "prefill_native_1.5b_2026-12-07.json", None),
    Figure("docs/benchmarks.md", "528 in 4.093 s against 6.482 s", "4.093", "prefill_native_1.5b_2026-12-07.json", None),
    Figure("docs/benchmarks.md", "528 in 4.093 s against 6.482 s", "6.482", "prefill_native_1.5b_2026-12-07.json", None),
    Figure("docs/design.md", "at 0.423 ms a layer for one row at `avx2`", "0.423",
           "verify_attention_avx2_2026-12-07.json", None),
    Figure("docs/design.md", "against 0.333 at\n`avx512bf16`", "0.333",
           "verify_attention_avx512bf16_2026-12-07.json", None),
    Figure("docs/design.md", "2.657 against", "2.657", "verify_attention_avx2_2026-12-07.json", None),
    Figure("docs/design.md", "against 2.081 for 8 rows", "2.081", "verify_attention_avx512bf16_2026-12-07.json", None),
    Figure("docs/benchmarks.md", "Speculation ran at **2.581x** llama-server's best", "2.581",
           "gguf_sessions_1.5b_c4_2026-12-07h.json", VS_BEST),
    Figure("docs/benchmarks.md", "and at\n**1.003x** our own plain batching", "1.003",
           "gguf_sessions_1.5b_c4_2026-12-07h.json", VS_PLAIN),
    Figure("docs/benchmarks.md", "our plain batching at 2.573x llama-server's", "2.573",
           "gguf_sessions_1.5b_c4_2026-12-07h.json", PLAIN_VS_LLAMA),
    *ratios("docs/benchmarks.md", "2026-12-07g.json`): 2.722x and 1.049x", "2.722", "1.049",
            "gguf_sessions_1.5b_c4_2026-12-07g.json"),
    *ratios("docs/benchmarks.md", "2026-12-07f.json`): 2.590x and 0.998x", "2.590", "0.998",
            "gguf_sessions_1.5b_c4_2026-12-07f.json"),
    *ratios("docs/benchmarks.md", "2026-12-07e.json`): 2.579x and 1.030x", "2.579", "1.030",
            "gguf_sessions_1.5b_c4_2026-12-07e.json"),
    Figure("docs/benchmarks.md", "Speculation ran at **1.602x** llama-server's best", "1.602",
           "gguf_sessions_1.5b_2026-12-06.json", VS_BEST),
    Figure("docs/benchmarks.md", "and 1.151x our\nown plain decoding", "1.151",
           "gguf_sessions_1.5b_2026-12-06.json", VS_PLAIN),
    Figure("docs/benchmarks.md", "The 0.5B as our draft model lost time (0.859x", "0.859",
           "gguf_sessions_1.5b_2026-12-06.json", ("summary", "agentspec:spec-draft-model", "vs_agentspec_plain")),
    Figure("docs/benchmarks.md", "So **1.725x**\nllama-server's best", "1.725",
           "gguf_sessions_1.5b_2026-12-06b.json", VS_BEST),
    Figure("docs/benchmarks.md", "llama-server's best and 1.106x our plain decoding", "1.106",
           "gguf_sessions_1.5b_2026-12-06b.json", VS_PLAIN),
    Figure("docs/benchmarks.md", "Speculation ran at **1.677x** llama-server's best", "1.677",
           "gguf_sessions_1.5b_c4_2026-12-06c.json", VS_BEST),
    Figure("docs/benchmarks.md", "and at **1.008x** our\nown plain batching", "1.008",
           "gguf_sessions_1.5b_c4_2026-12-06c.json", VS_PLAIN),
    Figure("docs/benchmarks.md", "took speculation from 0.881x of plain batching", "0.881",
           "gguf_sessions_1.5b_c4_2026-12-06.json", VS_PLAIN),
    Figure("docs/benchmarks.md", "with the first alone:\n`benchmarks/results/gguf_sessions_1.5b_c4_2026-12-06b.json`, 0.948x",
           "0.948", "gguf_sessions_1.5b_c4_2026-12-06b.json", VS_PLAIN),
    Figure("docs/benchmarks.md", "four requests of four rows took 17.64 ms a layer, now 5.74", "17.64",
           "verify_attention_groups.json", None),
    Figure("docs/benchmarks.md", "**1.418x** llama-server's best and 1.004x", "1.418",
           "gguf_sessions-elided_1.5b_2026-12-06.json", VS_BEST),
    Figure("docs/benchmarks.md", "our decoding ran at 2.438x llama-server's speed", "2.438",
           "gguf_grid_qwen2.5-coder-1.5b_32k_2026-12-06.json",
           ("summary", "agentspec:plain", "ctx32000_c1", "decode_ms_per_token", "agentspec_speed_vs_llama")),
    Figure("docs/benchmarks.md", "float32 KV cache and\n2.514x with bfloat16", "2.514",
           "gguf_grid_qwen2.5-coder-1.5b_32k_2026-12-06.json",
           ("summary", "agentspec:plain-kv-bf16", "ctx32000_c1", "decode_ms_per_token", "agentspec_speed_vs_llama")),
    Figure("README.md", "ran at 2.357x llama-server's best configuration", "2.357",
           "gguf_tools_1.5b_2026-12-06d.json", VS_BEST),
    Figure("docs/agents.md", "prefill included: **2.357x**", "2.357",
           "gguf_tools_1.5b_2026-12-06d.json", VS_BEST),
    Figure("docs/benchmarks.md", "**2.418x** with `Write` required", "2.418",
           "gguf_tools-write_1.5b_2026-12-06c.json", VS_BEST),
    Figure("docs/benchmarks.md", "**2.217x** through Messages", "2.217",
           "gguf_tools-messages_1.5b_2026-12-06.json", VS_BEST),
    Figure("docs/benchmarks.md", "The decode phase ran at **3.038x** our plain decoding", "3.038",
           "gguf_tools_1.5b_2026-12-06d.json", ("summary", "agentspec:spec", "decode_vs_agentspec_plain")),
    Figure("docs/benchmarks.md", "| 256 | 516.16 ms | 343.93 ms | 1461.01 ms | 1168.83 ms |", "343.93",
           "quant_linears_amx_qwen2.5-coder-1.5b_2026-12-06.json", None),
    Figure("docs/benchmarks.md", "| 256 | 516.16 ms | 343.93 ms | 1461.01 ms | 1168.83 ms |", "516.16",
           "quant_linears_amx_qwen2.5-coder-1.5b_2026-12-06.json", None),
    Figure("docs/benchmarks.md", "| 512 | 2795.22 ms, 240 G/s | 63% |", "2795.22",
           "quant_linears_qwen2.5-coder-1.5b_2026-12-05.json", None),
    Figure("docs/benchmarks.md", "| 512 | 2795.22 ms, 240 G/s | 63% | 1074.96 ms, 624 G/s | 82% |", "1074.96",
           "quant_linears_qwen2.5-coder-1.5b_2026-12-05.json", None),
    Figure("docs/benchmarks.md", "| rows | AVX2 body | of its loop (382 G/s) |", "382",
           "quant_linears_qwen2.5-coder-1.5b_2026-12-05.json", ("peak_loops", "avx2", "gmacs_per_s")),
    Figure("docs/benchmarks.md", "| AVX512-VNNI body | of its loop (757 G/s) |", "757",
           "quant_linears_qwen2.5-coder-1.5b_2026-12-05.json", ("peak_loops", "avx512vnni", "gmacs_per_s")),
    Figure("docs/benchmarks.md", "| 4k context, c = 1: ms per token | 29.85 | **27.15** | 37.14 |", "29.85",
           "gguf_grid_qwen2.5-coder-1.5b_2026-12-05d.json", ("cells", "agentspec:plain", "ctx4096_c1", "decode_ms_per_token")),
    Figure("docs/benchmarks.md", "| 4k context, c = 1: ms per token | 29.85 | **27.15** | 37.14 |", "37.14",
           "gguf_grid_qwen2.5-coder-1.5b_2026-12-05d.json", ("cells", "llama.cpp:plain", "ctx4096_c1", "decode_ms_per_token")),
    Figure("docs/benchmarks.md", "| 4k context, c = 8: tokens/s | 72.67 | **76.68** | 36.23 |", "36.23",
           "gguf_grid_qwen2.5-coder-1.5b_2026-12-05d.json", ("cells", "llama.cpp:plain", "ctx4096_c8", "decode_tokens_per_s")),
    Figure("docs/benchmarks.md", "| 1k context, c = 1: ms per token | **22.30** | 28.49 * | 26.64 |", "22.30",
           "gguf_grid_qwen2.5-coder-1.5b_2026-12-05d.json", ("cells", "agentspec:plain", "ctx1024_c1", "decode_ms_per_token")),
    Figure("docs/benchmarks.md", "| prefill tokens/s, 1k / 4k (c = 1) | 355.5 / 234.5 |", "355.5",
           "gguf_grid_qwen2.5-coder-1.5b_2026-12-05d.json", ("cells", "agentspec:plain", "ctx1024_c1", "prefill_tokens_per_s")),
    Figure("docs/benchmarks.md", "gave 27.31 ms (float32\nKV), 22.53 (bfloat16) and llama-server's 25.99", "27.31",
           "gguf_grid_qwen2.5-coder-1.5b_1k_2026-12-05e.json", ("cells", "agentspec:plain", "ctx1024_c1", "decode_ms_per_token")),
    Figure("docs/benchmarks.md", "gave 27.31 ms (float32\nKV), 22.53 (bfloat16) and llama-server's 25.99", "25.99",
           "gguf_grid_qwen2.5-coder-1.5b_1k_2026-12-05e.json", ("cells", "llama.cpp:plain", "ctx1024_c1", "decode_ms_per_token")),
    Figure("docs/benchmarks.md", "| 8k context, c = 1 (previous arithmetic): ms per token | 41.03 | **38.27** | 55.17 |", "38.27",
           "gguf_grid_qwen2.5-coder-1.5b_8k_2026-12-05.json",
           ("cells", "agentspec:plain-kv-bf16", "ctx8000_c1", "decode_ms_per_token")),
    Figure("docs/benchmarks.md", "| 4k context, c = 8: tokens/s | **172.1** | 148.6 | 58.3 |", "172.1",
           "gguf_grid_qwen2.5-coder-0.5b_2026-12-05.json", ("cells", "agentspec:plain", "ctx4096_c8", "decode_tokens_per_s")),
    Figure("docs/benchmarks.md", "| decode ms per token | **99.55** | 113.85 | 1.14x |", "113.85",
           "gguf_grid_qwen2.5-7b-shape_2026-12-05b.json", ("cells", "llama.cpp:plain", "ctx1024_c1", "decode_ms_per_token")),
    Figure("docs/benchmarks.md", "| decode ms per token | **99.55** | 113.85 | 1.14x |", "99.55",
           "gguf_grid_qwen2.5-7b-shape_2026-12-05b.json", ("cells", "agentspec:plain", "ctx1024_c1", "decode_ms_per_token")),
    Figure("docs/benchmarks.md", "| 0.5B file (0.46 GiB) | **75.52** | **217.77** (18.9) |", "217.77",
           "gguf_qwen2.5-coder-0.5b_2026-12-05e.json", ("summary", "agentspec:spec", "tokens_per_s")),
    Figure("docs/benchmarks.md", "| 0.5B file (0.46 GiB) | **75.52** | **217.77** (18.9) | 45.20 | 82.51 |", "82.51",
           "gguf_qwen2.5-coder-0.5b_2026-12-05e.json", ("summary", "llama.cpp:ngram-simple", "tokens_per_s")),
    Figure("docs/benchmarks.md", "| 1.5B file (1.04 GiB) | **31.23** | **87.87** (18.2) | 26.03 |", "26.03",
           "gguf_qwen2.5-coder-1.5b_2026-12-05e.json", ("summary", "llama.cpp:plain", "tokens_per_s")),
    Figure("docs/benchmarks.md", "| 1.5B file (1.04 GiB) | **31.23** | **87.87** (18.2) |", "87.87",
           "gguf_qwen2.5-coder-1.5b_2026-12-05e.json", ("summary", "agentspec:spec", "tokens_per_s")),
    Figure("docs/benchmarks.md", "| 1.5B file (1.04 GiB) | **31.23** | **87.87** (18.2) | 26.03 | 43.42 | 43.20 | **2.02x** |",
           "2.02", "gguf_qwen2.5-coder-1.5b_2026-12-05e.json", VS_BEST),
    Figure("docs/benchmarks.md", "| 1k context, c = 1: ms per token | **35.60** | 39.72 | 1.116x |", "39.72",
           "gguf_grid_qwen2.5-coder-1.5b_avx2_2026-12-07.json", ("cells", "llama.cpp:plain", "ctx1024_c1", "decode_ms_per_token")),
    Figure("docs/benchmarks.md", "| 1k context, c = 1: ms per token | **35.60** | 39.72 | 1.116x |", "35.60",
           "gguf_grid_qwen2.5-coder-1.5b_avx2_2026-12-07.json", ("cells", "agentspec:plain", "ctx1024_c1", "decode_ms_per_token")),
    Figure("docs/benchmarks.md", "| 4k context, c = 8: tokens/s | **35.05** | 17.71 | 1.979x |", "35.05",
           "gguf_grid_qwen2.5-coder-1.5b_avx2_2026-12-07.json", ("cells", "agentspec:plain", "ctx4096_c8", "decode_tokens_per_s")),
    Figure("docs/benchmarks.md", "Ours with speculation 26.36 tokens/s", "26.36",
           "gguf_turns_qwen2.5-coder-1.5b_2026-12-05c.json", ("summary", "agentspec:spec", "tokens_per_s")),
    Figure("docs/benchmarks.md", "speculation 16.29\ntokens/s, plain 14.76, llama-server plain 10.91", "10.91",
           "gguf_turns_qwen2.5-coder-1.5b_avx2_2026-12-05b.json", ("summary", "llama.cpp:plain", "tokens_per_s")),
    Figure("docs/benchmarks.md", "llama-server plain 15.65", "15.65",
           "gguf_turns_qwen2.5-coder-1.5b_2026-12-05c.json", ("summary", "llama.cpp:plain", "tokens_per_s")),
    Figure("docs/benchmarks.md", "ours with speculation 10.15 tokens/s", "10.15",
           "gguf_turns_qwen2.5-coder-1.5b_2026-12-07.json", ("summary", "agentspec:spec", "tokens_per_s")),
    Figure("docs/benchmarks.md", "suffix drafts (`--draft-model`) 10.69", "10.69",
           "gguf_turns_qwen2.5-coder-1.5b_2026-12-07.json", ("summary", "agentspec:spec-draft-model", "tokens_per_s")),
    Figure("docs/benchmarks.md", "llama-server plain 5.56", "5.56",
           "gguf_turns_qwen2.5-coder-1.5b_2026-12-07.json", ("summary", "llama.cpp:plain", "tokens_per_s")),
    Figure("docs/benchmarks.md", "`draft-simple` 4.02", "4.02",
           "gguf_turns_qwen2.5-coder-1.5b_2026-12-07.json", ("summary", "llama.cpp:draft-simple", "tokens_per_s")),
    Figure("docs/benchmarks.md", "ours takes 1.70 s per merge against llama-server's 7.91", "1.70",
           "apply_qwen2.5-coder-0.5b_2026-12-05b.json", ("summary", "agentspec", "aider", "s_per_merge")),
    Figure("docs/benchmarks.md", "| agentspec, speculation | 0 / 0 / 0 | **3.85** |", "3.85",
           "apply_qwen2.5-coder-1.5b_2026-12-05d.json", ("summary", "agentspec", "aider", "s_per_merge")),
    Figure("docs/benchmarks.md", "| llama-server `ngram-simple` | 0 (aider) | 8.04 |", "8.04",
           "apply_qwen2.5-coder-1.5b_2026-12-05d.json", ("summary", "llama.cpp:ngram-simple", "aider", "s_per_merge")),
    Figure("docs/benchmarks.md", "decodes 99.13 tokens/s", "99.13",
           "gguf_grid_qwen2.5-coder-1.5b_c16_2026-12-05.json",
           ("cells", "agentspec:plain", "ctx1024_c16", "decode_tokens_per_s")),
    Figure("docs/benchmarks.md", "| 4 rewrites, one at a time | 90.92 (18.2) | 85.14 (17.6)", "85.14",
           "gguf_workspace_qwen2.5-coder-1.5b_2026-12-05c.json", ("summary", "agentspec:workspace", "tokens_per_s")),
    Figure("docs/benchmarks.md", "| 4 rewrites, one at a time | 90.92 (18.2)", "90.92",
           "gguf_workspace_qwen2.5-coder-1.5b_2026-12-05c.json", ("summary", "agentspec:spec", "tokens_per_s")),
    Figure("docs/benchmarks.md", "| 3 agent turns, one at a time | 28.09 (2.7) | 28.71 (2.6)", "28.71",
           "gguf_turns_workspace_qwen2.5-coder-1.5b_2026-12-05b.json", ("summary", "agentspec:workspace", "tokens_per_s")),
    Figure("docs/benchmarks.md", "(0.94x, 1.02x and 1.01x", "0.94",
           "gguf_workspace_qwen2.5-coder-1.5b_2026-12-05c.json", ("summary", "agentspec:workspace", "vs_agentspec_spec")),
    Figure("docs/benchmarks.md", "(0.94x, 1.02x and 1.01x", "1.02",
           "gguf_turns_workspace_qwen2.5-coder-1.5b_2026-12-05b.json", ("summary", "agentspec:workspace", "vs_agentspec_spec")),
    Figure("docs/benchmarks.md", "| 16 agent turns, 8 in flight | 33.54 (1.5) | 33.99 (1.4)", "33.99",
           "gguf_turns_workspace_qwen2.5-coder-1.5b_c8_2026-12-05b.json", ("summary", "agentspec:workspace", "tokens_per_s")),
    Figure("docs/benchmarks.md", "is 4.91 s\nwith the index against 4.93 s", "4.91",
           "gguf_turns_workspace_qwen2.5-coder-1.5b_2026-12-05b.json", ("summary", "agentspec:workspace", "median_ttft_s")),
    Figure("docs/benchmarks.md", "decoded at 24.54 tok/s plain and 45.87 with speculation", "45.87",
           "gguf_qwen2.5-coder-1.5b_avx2_2026-12-05e.json", ("summary", "agentspec:spec", "tokens_per_s")),
    Figure("docs/benchmarks.md", "plain\nand 27.03 with `ngram-mod`", "27.03",
           "gguf_qwen2.5-coder-1.5b_avx2_2026-12-05e.json", ("summary", "llama.cpp:ngram-mod", "tokens_per_s")),
    Figure("docs/benchmarks.md", "1.16x plain, **1.70x** its best", "1.70",
           "gguf_qwen2.5-coder-1.5b_avx2_2026-12-05e.json", VS_BEST),
    Figure("README.md", "at **218 tokens/s against llama.cpp's own server's 83**", "218",
           "gguf_qwen2.5-coder-0.5b_2026-12-05e.json", ("summary", "agentspec:spec", "tokens_per_s")),
    Figure("README.md", "at **218 tokens/s against llama.cpp's own server's 83**", "83",
           "gguf_qwen2.5-coder-0.5b_2026-12-05e.json", ("summary", "llama.cpp:ngram-simple", "tokens_per_s")),
    Figure("README.md", "best draftless speculation (**2.64x**;", "2.64",
           "gguf_qwen2.5-coder-0.5b_2026-12-05e.json", VS_BEST),
    Figure("README.md", "on the 1.5B file **2.02x** one request at a time", "2.02",
           "gguf_qwen2.5-coder-1.5b_2026-12-05e.json", VS_BEST),
    Figure("README.md", "and **2.03x** with 8 in flight", "2.03",
           "gguf_load_qwen2.5-coder-1.5b_c8_2026-12-05c.json", VS_BEST),
    Figure("docs/benchmarks.md", "| 16 rewrites, c = 8 | **72.74** | **95.05** (4.6) |", "95.05",
           "gguf_load_qwen2.5-coder-1.5b_c8_2026-12-05c.json", ("summary", "agentspec:spec", "tokens_per_s")),
    Figure("docs/benchmarks.md", "| 16 agent turns, c = 8 | **28.16** | **30.03** (1.5) | 14.57 |", "14.57",
           "gguf_turns_qwen2.5-coder-1.5b_c8_2026-12-05b.json", ("summary", "llama.cpp:plain", "tokens_per_s")),
    Figure("docs/benchmarks.md", "| 0.5B file: 16 rewrites, c = 8 | **173.62** | **238.64** (4.7) |", "238.64",
           "gguf_load_qwen2.5-coder-0.5b_c8_2026-12-05b.json", ("summary", "agentspec:spec", "tokens_per_s")),
    Figure("docs/benchmarks.md", "| AVX2 on both sides: 16 rewrites, c = 8 | **40.83** | **46.89** (4.6) |", "46.89",
           "gguf_load_qwen2.5-coder-1.5b_avx2_c8_2026-12-05.json", ("summary", "agentspec:spec", "tokens_per_s")),
    Figure("docs/benchmarks.md", "| AVX2 on both sides: 16 rewrites, c = 8 | **40.83** | **46.89** (4.6) | 24.24 | 28.28 | 28.79 | **1.63x** |",
           "1.63", "gguf_load_qwen2.5-coder-1.5b_avx2_c8_2026-12-05.json", VS_BEST),
    Figure("docs/benchmarks.md", "| AVX2 on both sides: 16 agent turns, c = 8 | **16.88** | **16.92** (1.3) | 9.70 |", "9.70",
           "gguf_turns_qwen2.5-coder-1.5b_avx2_c8_2026-12-05.json", ("summary", "llama.cpp:plain", "tokens_per_s")),
    Figure("docs/benchmarks.md", "| 16 rewrites, c = 16 | **81.61** | **95.61** (2.5) |", "95.61",
           "gguf_load_qwen2.5-coder-1.5b_c16_2026-12-05c.json", ("summary", "agentspec:spec", "tokens_per_s")),
    Figure("docs/benchmarks.md", "| agentspec, prefix cache + speculation | **0.56 s** | **25.8 s** |", "25.8",
           "agent_loop_amx_decode.json", ("summary", "cache+spec", "conversation_total_s")),
    Figure("docs/benchmarks.md", "lowers TTFT from turn 3 on **5.2x**", "5.2",
           "agent_loop_amx_decode.json", ("summary", "ttft_ratio_turn3plus_cache_on_vs_off")),
    Figure("docs/benchmarks.md", "| 8 rewrites, total | **29.0 s** | 97.0 s | **3.34x**", "3.34",
           "editor.json", ("rewrites", "speedup_total")),
    Figure("docs/benchmarks.md", "(suffix index, cost-cut drafts; MAT 4.82) | **190.2**", "190.2",
           "e2e_2026-11-30_peers.json", ("summary", "agentspec_spec", "tokens_per_s")),
    Figure("docs/benchmarks.md", "| `/v1/apply` | 161.5 | 55.1 | 2.93x", "2.93",
           "server_2026-12-03.json", ("summary", "apply_speedup")),
    Figure("docs/benchmarks.md", "| rewrites | 8 | 140.0 | 213.7 | **1.53x**", "1.53",
           "throughput_2026-12-03b_c8-16.json", ("summary", "rewrites", "8", "load_aware_vs_plain")),
    Figure("docs/benchmarks.md", "| rewrites | 1 | 53.0 | 122.2 | **2.31x**", "2.31",
           "throughput_2026-12-03b_c1-4.json", ("summary", "rewrites", "1", "load_aware_vs_plain")),
    Figure("docs/benchmarks.md", "| **agentspec** (suffix index) | **25.22** |", "25.22",
           "replay_2026-11-30.json", ("datasets", "file_rewrites", "agentspec", "held_out", "mat")),
    Figure("docs/benchmarks.md", "| insert, outputs as history | 6.18 M tok/s | 0.47 M tok/s | 13.1x |", "13.1",
           "index_2026-11-29.json", ("ratios", "insert_history_vs_arctic_response")),
    Figure("docs/benchmarks.md", "| rewrites | 1.38 | 1.70 | 3.46 | **3.99** |", "3.99",
           "sglang_hybrid_cpu_recorded.json", ("results", "hybrid", "rewrites", "accept_length_tokens_per_verify")),
    Figure("docs/benchmarks.md", "| suffix + eagle3 | 7.28 (1.17x)", "7.28",
           "eagle3/acceptance.json", ("results", "agent", "suffix+eagle3", "tau")),
    Figure("docs/benchmarks.md", "| agent turns | 1 | 29.3 | 71.7 | 87.8 (1.22x)", "87.8",
           "eagle3/e2e_gpu_h200.json", ("results", "agent", "1", "suffix+eagle3", "tokens_per_s")),
    Figure("docs/sglang.md", "| AGENTSPEC | 25.2 | 30.8 | 94.3 |", "94.3",
           "sglang_gpu_2026-12-04.json", ("bench", "results", "agentspec", "batches", "c16", "tokens_per_s")),
    Figure("docs/design.md", "737 of 896 with the bf16 path", "737",
           "precision_2026-11-29.json", ("agreeing_tokens", "bf16_fused")),
    Figure("docs/design.md", "0.08 with the AVX512-BF16 kernels", "0.08",
           "e2e_2026-11-30_peers.json", ("identity", "row_cost")),
    Figure("docs/models.md", "| agentspec, 1k context | 127.9 |", "127.9",
           "model_sizes_qwen2.5-coder-1.5b.json", ("step_ms", "1024", "1")),
    Figure("docs/operations.md", "| requests | 5,267:", "5,267", "soak_2026-12-04.json", None),
]


def check_figure(fig: Figure, text: str) -> list[str]:
    """What is wrong with ``fig`` in a document whose text is ``text`` (empty: nothing)."""
    problems = []
    if fig.number not in fig.quote:
        problems.append(f"{fig.number!r} is not within its quote {fig.quote!r}")
    if flat(fig.quote) not in flat(text):
        problems.append(f"{fig.doc} no longer quotes {fig.quote!r}")
    if f"benchmarks/results/{fig.file}" not in text:
        problems.append(f"{fig.doc} does not cite benchmarks/results/{fig.file}")
    if not (RESULTS / fig.file).is_file():
        return problems + [f"benchmarks/results/{fig.file} does not exist"]
    data = results(fig.file)
    if fig.path is None:
        if not any(rounds_to(v, fig.number) for v in numbers(data)):
            problems.append(f"no number in {fig.file} rounds to {fig.number}")
        return problems
    value = data
    for key in fig.path:
        if not isinstance(value, dict) or key not in value:
            return problems + [f"{fig.file} has no {'/'.join(fig.path)}"]
        value = value[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        problems.append(f"{fig.file} {'/'.join(fig.path)} is {value!r}, not a number")
    elif not rounds_to(value, fig.number):
        problems.append(f"{fig.file} {'/'.join(fig.path)} is {value}, which does not round to {fig.number}")
    return problems


@pytest.mark.parametrize("fig", FIGURES, ids=[f"{f.doc}:{f.number}" for f in FIGURES])
def test_headline_figure_is_in_its_results_file(fig: Figure):
    assert check_figure(fig, doc_text(fig.doc)) == []


# ---------------------------------------------------------------------------------------------
# Ranges: a "lo-hi" figure summarising several values of its results files


def _vllm_in_process() -> list[float]:
    """Load-aware batching (the interleaved run) over vLLM suffix decoding (the run with vLLM),
    rewrites at c = 8 and 16: the docs' "1.7-1.9x in process"."""
    ours = results("throughput_2026-12-03c_rewrites_interleaved.json")["results"]["rewrites"]
    vllm = results("throughput_2026-12-03b_c8-16.json")["results"]["rewrites"]
    return [ours[c]["ours_load_aware"]["tokens_per_s"] / vllm[c]["vllm_suffix"]["tokens_per_s"] for c in ("8", "16")]


def _vllm_server() -> list[float]:
    ours = results("throughput_2026-12-03c_rewrites_interleaved.json")["results"]["rewrites"]
    vllm = results("throughput_2026-12-03b_c8-16.json")["results"]["rewrites"]
    return [ours[c]["server_spec"]["tokens_per_s"] / vllm[c]["vllm_suffix"]["tokens_per_s"] for c in ("8", "16")]


def _eagle3_cpu() -> list[float]:
    """suffix + eagle3 over suffix alone, every cell of the CPU run."""
    res = results("eagle3/e2e_cpu.json")["results"]
    return [cells["suffix+eagle3"]["speed_vs_suffix"] for wl in res.values() for cells in wl.values()]


@dataclass(frozen=True)
class Range:
    doc: str
    quote: str
    lo: str
    hi: str
    files: tuple[str, ...]
    values: Callable[[], list[float]]


RANGES = [
    Range("docs/benchmarks.md", "speculation is 1.7-1.9x in process", "1.7", "1.9",
          ("throughput_2026-12-03c_rewrites_interleaved.json", "throughput_2026-12-03b_c8-16.json"), _vllm_in_process),
    Range("docs/benchmarks.md", "and 1.3-1.7x through the server", "1.3", "1.7",
          ("throughput_2026-12-03c_rewrites_interleaved.json", "throughput_2026-12-03b_c8-16.json"), _vllm_server),
    Range("docs/benchmarks.md", "suffix + eagle3 runs at 0.98-1.08x of suffix", "0.98", "1.08",
          ("eagle3/e2e_cpu.json",), _eagle3_cpu),
]


def check_range(r: Range, text: str) -> list[str]:
    problems = []
    if f"{r.lo}-{r.hi}" not in r.quote:
        problems.append(f"{r.lo}-{r.hi} is not within its quote {r.quote!r}")
    if flat(r.quote) not in flat(text):
        problems.append(f"{r.doc} no longer quotes {r.quote!r}")
    problems += [f"{r.doc} does not cite benchmarks/results/{f}" for f in r.files
                 if f"benchmarks/results/{f}" not in text]
    values = r.values()
    if not rounds_to(min(values), r.lo) or not rounds_to(max(values), r.hi):
        problems.append(f"the values run {min(values):.3f}-{max(values):.3f}, not {r.lo}-{r.hi}")
    return problems


@pytest.mark.parametrize("r", RANGES, ids=[f"{r.doc}:{r.lo}-{r.hi}" for r in RANGES])
def test_range_spans_its_values(r: Range):
    assert check_range(r, doc_text(r.doc)) == []


# ---------------------------------------------------------------------------------------------
# Negative tests: each check fails on a planted mistake


def test_rounding_is_half_up_at_the_written_precision():
    assert rounds_to(45.65, "45.7") and rounds_to(190.15, "190.2") and rounds_to(5267, "5,267")
    assert not rounds_to(190.15, "190.3") and not rounds_to(190.15, "191") and not rounds_to(0.983, "0.99")


def test_citation_check_catches_a_missing_file():
    good = "See `benchmarks/results/server_2026-12-03.json` and benchmarks/results/eagle3/.\n"
    assert check_citations(good) == []
    problems = check_citations("See `benchmarks/results/server_2026-12-33.json`.\n")
    assert problems and "server_2026-12-33.json" in problems[0]


def test_figure_check_catches_a_wrong_number():
    fig = next(f for f in FIGURES if f.number == "190.2")
    text = doc_text(fig.doc)
    wrong = Figure(fig.doc, fig.quote.replace("190.2", "190.3"), "190.3", fig.file, fig.path)
    problems = check_figure(wrong, text.replace("190.2", "190.3"))
    assert problems and any("does not round to 190.3" in p for p in problems), problems
    loose = Figure(fig.doc, wrong.quote, "190.3", fig.file, None)   # anywhere in the file: still absent
    assert any("no number" in p for p in check_figure(loose, text.replace("190.2", "190.3")))


def test_figure_check_catches_a_figure_the_doc_no_longer_quotes_or_cites():
    fig = next(f for f in FIGURES if f.number == "2.93")
    text = doc_text(fig.doc)
    assert any("no longer quotes" in p for p in check_figure(fig, text.replace("2.93x", "2.95x")))
    assert any("does not cite" in p for p in check_figure(fig, text.replace(fig.file, "server.json")))


def test_range_check_catches_a_wrong_end():
    r = RANGES[0]
    text = doc_text(r.doc)
    wrong = Range(r.doc, r.quote.replace("1.7-1.9x", "1.7-1.8x"), "1.7", "1.8", r.files, r.values)
    problems = check_range(wrong, text.replace("1.7-1.9x", "1.7-1.8x"))
    assert problems and "not 1.7-1.8" in problems[-1], problems
