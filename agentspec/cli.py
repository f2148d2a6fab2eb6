"""Command line: ``agentspec serve | generate | demo | index | stats | lsp | train-eagle3``.

Exit codes, the same for every command: 0 done; 2 bad input or usage (a flag, a file, a config
value, a device: the message names the value and the fix; argparse's own errors too); 1 a
failure at run time (a port in use, a server that stopped, an OS error, ``demo``'s outputs
differing); 130 interrupted (Ctrl-C); 141 output into a pipe that closed early. Messages go to
stderr as ``agentspec <command>: ...``, never as a traceback for these cases.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

__all__ = ["main"]


class UsageError(Exception):
    """Bad input to a command (exit 2): the message names the value and says what to do instead."""


def _number(name: str, kind: type, *, low: float, strict: bool, high: float | None = None):
    """An argparse type: ``text`` as ``kind`` (int or float), > ``low`` when ``strict``, else >= ``low``,
    and <= ``high`` when given; otherwise an error naming ``name`` and the value."""
    what = "an integer" if kind is int else "a number"
    bound = f"{'>' if strict else '>='} {low:g}" + (f" and <= {high:g}" if high is not None else "")

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be {what}, got {text!r}") from None
        if not (v > low if strict else v >= low) or (high is not None and not v <= high):   # NaN fails both
            raise argparse.ArgumentTypeError(f"{name} must be {bound}, got {text if kind is float else v}")
        return v

    parse.describes = f"{'integer' if kind is int else 'number'} {bound}"   # docs/configuration.md's type column
    return parse


def _positive_int(name: str):
    return _number(name, int, low=0, strict=True)


def _nonneg_int(name: str):
    return _number(name, int, low=0, strict=False)


def _nonneg_float(name: str):
    return _number(name, float, low=0, strict=False)


# the engine's bounds, here so that parsing imports nothing (``agentspec --help`` and ``stats`` load
# no backend); tests/unit/test_cli_exit_codes.py checks they agree with the engine's
MAX_TEMPERATURE = 2.0    # backends.protocol.MAX_TEMPERATURE
GREEDY_BELOW = 1e-5      # backends.protocol.GREEDY_BELOW: a temperature under it samples as greedy (0)
SPEC_BUDGET_MAX = 1024   # SpecConfig.budget's upper bound


def _temperature(name: str):
    """A sampling temperature: a number in [0, MAX_TEMPERATURE] (the engine's range); below
    ``GREEDY_BELOW`` it is greedy, 0, as the server takes it (a temperature near 0 would
    overflow the logits it divides)."""
    check = _number(name, float, low=0, strict=False, high=MAX_TEMPERATURE)

    def parse(text: str) -> float:
        v = check(text)
        return 0.0 if v < GREEDY_BELOW else v

    parse.describes = f"{check.describes}; under {GREEDY_BELOW:g}: 0".replace("e-0", "e-")
    return parse


_CUDA = re.compile(r"cuda(?::(\d+))?")
# SGLang's own device names (its --device help): it checks what is present itself
SGLANG_DEVICES = ("cuda", "cpu", "xpu", "hpu", "npu", "musa")


def check_device(device: str | None, *, flag: str = "--device", backend: str = "embedded") -> None:
    """UsageError (exit 2) for a device the engine cannot run on, before any model loads:
    the embedded engine and training take ``cpu``, ``cuda`` or ``cuda:N`` of a GPU torch finds;
    SGLang takes its own device names."""
    if device is None:
        return
    if backend == "sglang":
        if device not in SGLANG_DEVICES:
            raise UsageError(f"{flag} {device!r} is not a device SGLang runs on: use one of {', '.join(SGLANG_DEVICES)}"
                             " (or leave it out: SGLang chooses)")
        return
    m = _CUDA.fullmatch(device)
    if device != "cpu" and m is None:
        hint = " (for an NVIDIA GPU: --device cuda)" if device.lower() in ("gpu", "nvidia", "cuda0") else ""
        raise UsageError(f"{flag} must be cpu, cuda or cuda:N (N: a GPU index), got {device!r}{hint}")
    if m is None:
        return
    import torch

    if not torch.cuda.is_available():
        why = ("this torch is a CPU-only build" if torch.version.cuda is None
               else f"torch (CUDA {torch.version.cuda}) finds no GPU")
        raise UsageError(f"{flag} {device}: CUDA is not available here ({why}); use {flag} cpu, or run where "
                         "a CUDA build of torch sees a GPU")
    n = torch.cuda.device_count()
    if m.group(1) is not None and int(m.group(1)) >= n:
        raise UsageError(f"{flag} {device}: there {'is' if n == 1 else 'are'} {n} CUDA device(s) here "
                         f"(cuda:0..cuda:{n - 1}); use one of those")


def _engine_args(p: argparse.ArgumentParser, *, deterministic: bool = True) -> None:
    """The engine options; ``deterministic=False`` leaves out --deterministic (``serve``: the
    server batches requests, which the deterministic mode does not support)."""
    p.add_argument("--model", help="a .gguf file or Hugging Face folder (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="weights dtype")
    p.add_argument("--kv-dtype", choices=["float32", "bfloat16"],
                   help="KV cache dtype (default bfloat16 where it gives float32's bits: the GGUF models on CPU, "
                        "whose keys and values are bfloat16 values; else float32). bfloat16 halves the cache's "
                        "memory and the bytes a long-context step reads")
    p.add_argument("--max-context", type=_positive_int("--max-context"), metavar="TOKENS",
                   help="context window in tokens, up to the model's own (default: the model's, capped at 8192; "
                        "agent CLIs' prompts run 8k-20k tokens: Qwen2.5-Coder takes 32768)")
    if deterministic:
        p.add_argument("--deterministic", action="store_true",
                       help="fixed-shape decode steps: greedy identity with plain decoding by construction")
    p.add_argument("--threads", type=_positive_int("--threads"),
                   help="CPU threads (default: the cores this process may use: affinity and cgroup quota)")
    p.add_argument("--cpu-isa", choices=["avx512bf16", "avx512", "avx2", "neon", "scalar"],
                   help="cap the native CPU kernels at this ISA (default: $AGENTSPEC_CPU_ISA or the best the CPU runs)")
    p.add_argument("--eagle3", metavar="DIR",
                   help="EAGLE-3 head for the 'eagle3' drafter (default: $AGENTSPEC_EAGLE3 or the head shipped "
                        "for the bundled model)")
    p.add_argument("--draft-model", metavar="FILE",
                   help="a smaller model of the same family and tokenizer (e.g. Qwen2.5-Coder-0.5B's GGUF for the 1.5B): "
                        "it drafts where no index holds the text, behind the suffix drafts, where its break-even says "
                        "it pays")
    p.add_argument("--no-eagle3-gate", action="store_true",
                   help="let the EAGLE-3 head draft whenever asked (no break-even gate; $AGENTSPEC_EAGLE3_GATE=0)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentspec", description="Model-free speculative decoding for coding agents.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion for a prompt (file or stdin)")
    g.add_argument("prompt_file", nargs="?", default="-", help="file holding the prompt, or - for stdin (default)")
    g.add_argument("--max-tokens", type=_positive_int("--max-tokens"), default=256, help="most tokens to generate")
    g.add_argument("--temperature", type=_temperature("--temperature"), default=0.0,
                   help="sampling temperature; 0 is greedy")
    g.add_argument("--top-p", type=_number("--top-p", float, low=0, strict=True, high=1), default=1.0,
                   help="sample from the most likely tokens up to this probability mass (1: all)")
    g.add_argument("--top-k", type=_nonneg_int("--top-k"), default=0,
                   help="sample from the k most likely tokens (0: all)")
    g.add_argument("--seed", type=int,
                   help="sampling seed: the output is a function of the seed, with or without speculation")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--budget", type=_number("--budget", int, low=0, strict=False, high=SPEC_BUDGET_MAX), default=32,
                   help="max draft tokens per step")
    g.add_argument("--no-spec", action="store_true", help="plain decoding, no speculation")
    g.add_argument("--drafters", help="comma-separated drafter names, e.g. suffix,eagle3 (default: suffix)")
    g.add_argument("--raw", action="store_true", help="tokenize the prompt as is (no chat template)")
    g.add_argument("--json", action="store_true", help="print text, token ids and stats as one JSON object")
    _engine_args(g)

    d = sub.add_parser("demo", help="rewrite a file with and without speculation; print both speeds")
    d.add_argument("--file", help="file to rewrite (default: a source file of this package)")
    d.add_argument("--instruction", default="Add a module docstring at the top. Keep everything else unchanged.",
                   help="the change to ask for")
    d.add_argument("--max-tokens", type=_positive_int("--max-tokens"), default=256,
                   help="most tokens to generate in each run")
    _engine_args(d)

    x = sub.add_parser("index", help="index a repository for drafting; print a summary")
    x.add_argument("directory", help="the repository's root folder")
    x.add_argument("--tenant", default="default", help="the tenant the files are indexed for")
    x.add_argument("--snapshot", help="folder to save the index in (and load it from next time)")
    x.add_argument("--max-file-bytes", type=_positive_int("--max-file-bytes"), default=1 << 20,
                   help="skip files larger than this many bytes")
    x.add_argument("--ignore", action="append", default=[], help="extra ignore pattern, gitignore syntax (repeatable)")
    x.add_argument("--json", action="store_true", help="print the summary as one JSON object (last line)")
    x.add_argument("--model", help="tokenize for this model (default: bundled SmolLM2-135M-Instruct)")

    sv = sub.add_parser("serve", help="run the OpenAI-compatible server (embedded engine or SGLang, speculation on)")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    sv.add_argument("--port", type=_port, default=8000, help="TCP port (default: 8000)")
    sv.add_argument("--repo", help="workspace to index and watch for drafting (default: none; `make run` passes .)")
    sv.add_argument("--config", help="server TOML file: tenants, API keys, routes, log_dir (docs/configuration.md)")
    sv.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                    help="uvicorn's log level (default: warning)")
    sv.add_argument("--insecure-no-auth", action="store_true",
                    help="allow binding a non-loopback address without API keys (no --config tenants)")
    _engine_args(sv, deterministic=False)
    sv.set_defaults(device=None)   # embedded: cpu; sglang: SGLang's own choice
    sv.add_argument("--backend", choices=["embedded", "sglang"], default="embedded",
                    help="the engine: the embedded torch engine (default) or an in-process SGLang engine "
                         "(in a clone: pip install -e '.[sglang]'; --model must be a Hugging Face folder)")
    sv.add_argument("--tp", type=_positive_int("--tp"), help="sglang: tensor-parallel size (default 1)")
    sv.add_argument("--dp", type=_positive_int("--dp"), help="sglang: data-parallel size (default 1)")
    sv.add_argument("--speculative", choices=["agentspec", "ngram", "eagle3", "hybrid", "none"],
                    help="sglang: the speculative algorithm: agentspec (default: drafts from the suffix index), "
                         "SGLang's ngram or eagle3 (head: --eagle3 DIR), hybrid (the suffix index and the EAGLE-3 "
                         "head, per request and step; --eagle3 DIR), or none")
    sv.add_argument("--draft-tokens", type=_draft_tokens, metavar="N",
                    help="sglang: speculative_num_draft_tokens, the tokens verified per step (default 8)")
    sv.add_argument("--sglang-arg", action="append", default=[], metavar="KEY=VALUE", type=_sglang_arg,
                    help="sglang: another sglang.Engine argument, e.g. attention_backend=intel_amx or "
                         "mem_fraction_static=0.3 (repeatable; ints, floats, true/false and none are parsed)")

    st = sub.add_parser("stats", help="acceptance statistics per tenant and route from the request logs")
    st.add_argument("--log-dir", default="logs", help="folder holding <tenant>.jsonl logs (default: logs)")
    st.add_argument("--tenant", type=_tenant_name, help="only this tenant")
    st.add_argument("--since", type=_since, help="only records from then on: ISO date/time or 15m, 2h, 7d")
    st.add_argument("--by", choices=["route", "session"], default="route",
                    help="rows per (tenant, route) (default) or per (tenant, session): requests, prompt, "
                         "cached and completion tokens, MAT, accepted/drafted, total e2e seconds")
    st.add_argument("--json", action="store_true", help="print the statistics as one JSON object")
    st.add_argument("--plot", metavar="PNG",
                    help="also draw acceptance by position and MAT by route to PNG (.png, or .svg / .pdf; "
                         "needs matplotlib)")
    ls = sub.add_parser("lsp", help="run the language server for editors (stdio): rewrites and fast apply",
                        description="The agentspec language server. Editors start it over stdio; settings come from "
                                    "initializationOptions / workspace/configuration (section 'agentspec'); the "
                                    "options here are defaults for them.")
    ls.add_argument("--tcp", metavar="[HOST:]PORT", type=_tcp_address,
                    help="listen on TCP instead of stdio (for debugging; default host 127.0.0.1; another host "
                         "needs $AGENTSPEC_LSP_TOKEN, which each peer sends as initializationOptions.token)")
    ls.add_argument("--url", help="an agentspec server to use (default: the embedded engine in this process)")
    ls.add_argument("--model", help="remote: the model id; in-process: a .gguf file or Hugging Face folder (default: the bundled model)")
    ls.add_argument("--config", help="in-process: server TOML (routes)")

    ca = sub.add_parser("cache", help="list or clear the converted-weight cache (GGUF files dequantized once)",
                        description="The converted-weight cache under $AGENTSPEC_CACHE_DIR or ~/.cache/agentspec "
                                    "(models/): one entry per GGUF file content and converter version, at most "
                                    "$AGENTSPEC_CACHE_MAX_GB gigabytes (default 20), least recently used out first.")
    ca.add_argument("action", choices=["list", "clear"],
                    help="list: the entries, most recently used first (name, size, last use, source file); "
                         "clear: remove entries (all, or those named), the next start converts again")
    ca.add_argument("names", nargs="*", help="clear: entry names as `agentspec cache list` prints them (default: all)")
    ca.add_argument("--json", action="store_true", help="list: print the entries as one JSON object")

    tr = sub.add_parser("train-eagle3", help="train an EAGLE-3 draft head for a target model (SGLang layout)")
    tr.add_argument("--target", help="the target model: .gguf file or Hugging Face folder (default: bundled)")
    tr.add_argument("--data", nargs="+", default=[], metavar="FILE",
                    help="JSON-lines prompts (records with 'prompt' or 'messages'); the target answers them")
    tr.add_argument("--distilled", nargs="+", default=[], metavar="FILE",
                    help="already distilled records (training.distill output) to train on as well")
    tr.add_argument("--out", required=True, help="head directory to write (config.json + model.safetensors)")
    tr.add_argument("--work", help="folder for distilled data and resumable state (default: OUT.work)")
    tr.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    tr.add_argument("--skip", type=_nonneg_int("--skip"), default=0,
                    help="leave out the first N records of each --data file and their conversations (held out)")
    tr.add_argument("--max-prompt", type=_positive_int("--max-prompt"), default=1536,
                    help="prompt tokens per record (a longer history keeps its system message and latest messages)")
    tr.add_argument("--max-tokens", type=_positive_int("--max-tokens"), default=192, help="response tokens")
    tr.add_argument("--samples", type=_nonneg_int("--samples"), default=1,
                    help="sampled responses per prompt besides the greedy one (default 1)")
    tr.add_argument("--temperature", type=_temperature("--temperature"), default=0.8,
                    help="temperature of the sampled responses")
    tr.add_argument("--concurrency", type=_positive_int("--concurrency"), default=8,
                    help="prompts the target answers at once while distilling")
    tr.add_argument("--draft-vocab", type=_positive_int("--draft-vocab"), default=8192,
                    help="tokens in the head's draft vocabulary")
    tr.add_argument("--epochs", type=_nonneg_float("--epochs"), default=4.0, help="passes over the training records")
    tr.add_argument("--max-len", type=_positive_int("--max-len"), default=1024,
                    help="tokens per training window (the last ones of a record)")
    tr.add_argument("--ttt-steps", type=_positive_int("--ttt-steps"), default=7,
                    help="training-time test steps: draft positions the head learns to predict ahead")
    tr.add_argument("--lr", type=_nonneg_float("--lr"), default=6e-4, help="peak learning rate")
    tr.add_argument("--batch-rows", type=_positive_int("--batch-rows"), default=8192,
                    help="loss rows per optimiser step")
    tr.add_argument("--eval-fraction", type=_nonneg_float("--eval-fraction"), default=0.05,
                    help="share of the conversations held out for evaluation")
    tr.add_argument("--time-limit", type=_nonneg_float("--time-limit"), help="stop training after this many seconds")
    tr.add_argument("--init", metavar="DIR", help="start from this head (continue training) instead of from scratch")
    tr.add_argument("--seed", type=int, default=0, help="seed of the sampled responses, the held-out split and training")
    return parser


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--port must be an integer, got {text!r}") from None
    if not 0 < v < 65536:
        raise argparse.ArgumentTypeError(f"--port must be in 1..65535, got {v}")
    return v


def _draft_tokens(text: str) -> int:
    v = _positive_int("--draft-tokens")(text)
    if v < 2:
        raise argparse.ArgumentTypeError(f"--draft-tokens must be >= 2 (the verified token and one draft), got {v}")
    return v


# sglang.Engine arguments that have a flag of their own (--sglang-arg must not set them)
_SGLANG_FLAGS = {"model_path": "--model", "tp_size": "--tp", "dp_size": "--dp", "device": "--device",
                 "dtype": "--dtype", "speculative_algorithm": "--speculative",
                 "speculative_num_draft_tokens": "--draft-tokens", "speculative_draft_model_path": "--eagle3"}


def _sglang_arg(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` -> (key, value): dashes in KEY become underscores; VALUE true/false -> bool,
    none/null -> None, an integer or a number -> int/float, JSON for lists and objects, else the
    string."""
    key, sep, raw = text.partition("=")
    key = key.strip().lstrip("-").replace("-", "_")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"--sglang-arg must be KEY=VALUE with KEY an sglang.Engine argument, "
                                         f"got {text!r}")
    if key in _SGLANG_FLAGS:
        raise argparse.ArgumentTypeError(f"--sglang-arg {key}: use {_SGLANG_FLAGS[key]} instead")
    raw = raw.strip()
    low = raw.lower()
    if low in ("true", "false"):
        return key, low == "true"
    if low in ("none", "null"):
        return key, None
    for conv in (int, float):
        try:
            return key, conv(raw)
        except ValueError:
            pass
    if raw[:1] in ("[", "{"):
        try:
            return key, json.loads(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--sglang-arg {key}: value is not valid JSON: {raw!r}") from None
    return key, raw


def _serve_backend_options(args) -> dict | None:
    """The SGLang backend's options from the serve flags (None for the embedded backend); flags
    that do not apply to the chosen backend raise ConfigError naming them."""
    from .errors import ConfigError

    if args.backend == "embedded":
        given = [flag for flag, value in (("--tp", args.tp), ("--dp", args.dp), ("--speculative", args.speculative),
                                          ("--draft-tokens", args.draft_tokens),
                                          ("--sglang-arg", args.sglang_arg or None)) if value]
        if given:
            raise ConfigError(f"{', '.join(given)} {'need' if len(given) > 1 else 'needs'} --backend sglang (the embedded engine runs on one device "
                              "and drafts with the routes' drafters)")
        return None
    given = [flag for flag, value in (("--threads", args.threads), ("--cpu-isa", args.cpu_isa),
                                      ("--kv-dtype", args.kv_dtype), ("--no-eagle3-gate", args.no_eagle3_gate),
                                      ("--max-context", args.max_context)) if value]
    if given:
        raise ConfigError(f"{', '.join(given)} {'are options' if len(given) > 1 else 'is an option'} of the embedded "
                          "engine, not of --backend sglang "
                          "(pass SGLang's own with --sglang-arg KEY=VALUE)")
    if not args.model:
        raise ConfigError("--backend sglang needs --model PATH: a Hugging Face model folder")
    speculative = args.speculative or "agentspec"
    if speculative in ("eagle3", "hybrid") and not args.eagle3:
        raise ConfigError(f"--speculative {speculative} needs --eagle3 DIR: the EAGLE-3 head folder (SGLang layout)")
    if args.eagle3 and speculative not in ("eagle3", "hybrid"):
        raise ConfigError(f"--eagle3 is the head of --speculative eagle3 or hybrid; with --speculative {speculative} "
                          "SGLang would not use it")
    if speculative == "none" and args.draft_tokens is not None:
        raise ConfigError("--draft-tokens needs speculation (--speculative agentspec, ngram or eagle3)")
    from agentspec.integrations.sglang.backend import sglang_available

    if not sglang_available():
        raise ConfigError("--backend sglang needs SGLang, which is not installed here: "
                          "pip install -e '.[sglang]' in a clone of agentspec (docs/sglang.md)")
    return {"model": args.model, "speculative": None if speculative == "none" else speculative,
            "draft_tokens": args.draft_tokens or 8, "eagle3": args.eagle3, "tp_size": args.tp or 1,
            "dp_size": args.dp or 1, "device": args.device, "dtype": args.dtype,
            "engine_kwargs": dict(args.sglang_arg)}


def cmd_serve(args) -> int:
    import time

    started = time.perf_counter()
    from .config import load_server_config
    from .server import bind_socket, build_state, is_loopback, serve

    sglang_options = _serve_backend_options(args)
    config = load_server_config(args.config)
    if not config.tenants and not is_loopback(args.host) and not args.insecure_no_auth:
        raise UsageError(f"refusing to serve {args.host!r} without API keys: configure tenants "
                         "with api_keys in --config, bind 127.0.0.1, or pass --insecure-no-auth")
    if args.repo is not None and not Path(args.repo).is_dir():
        raise UsageError(f"--repo is not a directory: {args.repo!r} (give the repository's root folder)")
    check_device(args.device, backend=args.backend)
    # bind before loading the model: a port in use ends the start at once (exit 1, naming it),
    # and the bound socket goes to uvicorn, so nothing can take the port in between
    sock = bind_socket(args.host, args.port)
    try:
        if sglang_options is not None:
            state = build_state(config, repo=args.repo, backend="sglang", sglang_options=sglang_options,
                                config_path=args.config)
        else:
            state = build_state(config, repo=args.repo, config_path=args.config,
                                engine_options={"model": args.model or config.server.model, "device": args.device or "cpu",
                                                "dtype": args.dtype, "kv_dtype": args.kv_dtype, "threads": args.threads,
                                                "max_context": args.max_context,
                                                "cpu_isa": args.cpu_isa, "eagle3": args.eagle3,
                                                "eagle3_gate": False if args.no_eagle3_gate else None,
                                                "draft_model": args.draft_model})
        serve(state, host=args.host, port=args.port, log_level=args.log_level, sock=sock, started=started)
    finally:
        sock.close()
    return 0


def _tenant_name(text: str) -> str:
    from .telemetry import validate_tenant

    try:
        return validate_tenant(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _since(text: str) -> float:
    from .telemetry import parse_since

    try:
        return parse_since(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_cache(args) -> int:
    import time

    from .backends.embedded import model_cache

    if args.action == "list" and args.names:
        raise UsageError(f"agentspec cache list takes no names (got {' '.join(args.names)}); "
                         "to remove entries: agentspec cache clear NAME ...")
    if args.action == "clear" and args.json:
        raise UsageError("--json goes with `agentspec cache list`")
    if args.action == "list":
        limit = model_cache.cache_limit_bytes()
        es = model_cache.entries()
        if args.json:
            print(json.dumps({"dir": str(model_cache.models_dir()), "limit_bytes": limit,
                              "total_bytes": sum(e.bytes for e in es), "entries": [e.to_dict() for e in es]}))
            return 0
        print(model_cache.summary())
        for e in es:
            used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used))
            state = "" if e.complete else "  (incomplete)"
            src = e.sources[0] if e.sources else "(source not recorded)"
            print(f"  {e.name}  {e.bytes / 1e9:.2f} GB  used {used}  from {src}{state}")
        return 0
    removed = model_cache.clear(args.names)
    freed = sum(e.bytes for e in removed)
    print(f"removed {len(removed)} entr{'y' if len(removed) == 1 else 'ies'} ({freed / 1e9:.2f} GB) from "
          f"{model_cache.models_dir()}")
    return 0


def cmd_stats(args) -> int:
    from .telemetry import (
        ReadReport,
        format_session_table,
        format_table,
        plot_summary,
        read_records,
        summarize,
        summarize_sessions,
    )

    by_session = getattr(args, "by", "route") == "session"
    if by_session and args.plot:
        raise UsageError("--plot draws routes; it does not go with --by session (drop one of them)")
    if args.plot:
        _check_plot_path(args.plot)
    report = ReadReport()
    try:
        records = read_records(args.log_dir, tenant=args.tenant, since=args.since, report=report)
        summary = summarize_sessions(records) if by_session else summarize(records)
    except FileNotFoundError as e:
        raise UsageError(f"{e} (--log-dir: the folder the server writes, its config's log_dir; "
                         "default logs in the folder it runs in)") from None
    if args.plot:
        try:
            plot_summary(summary, args.plot)
        except ImportError:   # a part of matplotlib that cannot load (a broken install)
            raise UsageError(_NO_MATPLOTLIB) from None
    if args.json:
        print(json.dumps({"log_dir": args.log_dir, "since": args.since, "records": report.records,
                          "skipped_lines": report.skipped, **({"by": "session"} if by_session else {}), **summary}))
        return 0
    if not report.records:
        print(f"no records in {args.log_dir!r}" + (f" for tenant {args.tenant!r}" if args.tenant else ""))
    else:
        print(format_session_table(summary) if by_session else format_table(summary))
    if report.skipped:
        print(f"skipped {report.skipped} unparseable line(s), first at {report.skipped_at[0]}", file=sys.stderr)
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


PLOT_SUFFIXES = (".png", ".svg", ".pdf")   # the format is the file name's: what matplotlib writes with no extra
_NO_MATPLOTLIB = ("--plot needs matplotlib, which is not installed here: pip install matplotlib "
                  "(or leave out --plot)")


def _check_plot_path(path: str) -> None:
    """UsageError for a ``--plot`` file that cannot be written, before the logs are read: a
    suffix matplotlib would not write, a folder that does not exist, no matplotlib."""
    p = Path(path)
    if p.suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"--plot {path!r}: the file name must end in {', '.join(PLOT_SUFFIXES[:-1])} or "
                         f"{PLOT_SUFFIXES[-1]} (the image format is taken from it), e.g. --plot acceptance.png")
    if not p.parent.is_dir():
        raise UsageError(f"--plot {path!r}: the folder {str(p.parent)!r} does not exist (create it, or plot "
                         "into an existing one)")
    try:
        import matplotlib  # noqa: F401 - what plot_summary draws with
    except ImportError:
        raise UsageError(_NO_MATPLOTLIB) from None


def cmd_index(args) -> int:
    from .backends.embedded.weights import load_checkpoint
    from .workspace import DEFAULT_IGNORE, Workspace

    root = Path(args.directory)
    if not root.is_dir():
        raise UsageError(f"not a directory: {args.directory!r} (give the repository's root folder)")
    tokenizer = load_checkpoint(args.model, quiet=args.json).tokenizer
    with Workspace(root, tenant=args.tenant, watch=False, tokenizer=tokenizer, snapshot=args.snapshot,
                   ignore=[*DEFAULT_IGNORE, *args.ignore], max_file_bytes=args.max_file_bytes,
                   progress=not args.json) as ws:
        summary = ws.summary()
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"indexed {summary['root']}: {summary['files']} files, {summary['chunks']} chunks, "
          f"{summary['tokens']} tokens in {summary['seconds']:.2f} s "
          f"({(summary['tokens_per_s'] or 0) / 1e3:.0f}k tokens/s), index {summary['index_bytes'] / 1e6:.1f} MB")
    if summary["skipped"]:
        print("skipped: " + ", ".join(f"{n} {reason}" for reason, n in sorted(summary["skipped"].items())))
    if args.snapshot:
        print(f"snapshot: {args.snapshot}")
    return 0


def _read_prompt(path: str) -> str:
    if path == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise UsageError("no prompt: give a prompt file or pipe the prompt on stdin")
        try:
            return sys.stdin.read()
        except UnicodeDecodeError:
            raise UsageError("the prompt on stdin is not UTF-8 text") from None
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"prompt file not found: {path!r} (give a file, or - to read stdin)")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"prompt file is not UTF-8 text: {path!r}") from None


def _make_engine(args):
    from . import Engine

    return Engine.embedded(model=args.model, device=args.device, dtype=args.dtype, kv_dtype=args.kv_dtype,
                           deterministic=args.deterministic, max_context=args.max_context,
                           threads=args.threads, cpu_isa=args.cpu_isa, eagle3=args.eagle3,
                           eagle3_gate=False if args.no_eagle3_gate else None, draft_model=args.draft_model)


def cmd_generate(args) -> int:
    import msgspec

    from . import SpecConfig
    from .errors import ConfigError

    # --temperature, --top-p and --budget: their ranges are the flags' types, checked by argparse
    text = _read_prompt(args.prompt_file)
    if not text.strip():
        where = "on stdin" if args.prompt_file == "-" else f"in {args.prompt_file!r}"
        raise UsageError(f"the prompt {where} is empty (or only whitespace): give some text to complete")
    drafters = None if not args.drafters else tuple(x.strip() for x in args.drafters.split(","))
    try:   # checked before the model loads
        spec = None if args.no_spec else SpecConfig(budget=args.budget)
    except ConfigError as e:
        raise UsageError(f"--budget: {e}") from None
    if spec is not None and drafters is not None:
        try:
            spec = SpecConfig(budget=args.budget, drafters=drafters)
        except ConfigError as e:
            raise UsageError(f"--drafters: {e}") from None
    check_device(args.device)
    engine = _make_engine(args)
    prompt = engine.tokenizer.encode(text) if args.raw else text
    g = engine.generate(prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, seed=args.seed, stop=args.stop, spec=spec)
    if args.json:
        print(msgspec.json.encode(g).decode())
    else:
        print(g.text)
        s = g.stats
        print(f"[agentspec] {s.completion_tokens} tokens in {s.seconds:.2f}s ({s.tokens_per_second:.1f} tok/s), "
              f"spec {'on' if s.spec_enabled else 'off'} ({s.spec_reason}), steps {s.steps}, "
              f"MAT {s.mean_acceptance_length:.2f}"
              + (f", accepted by source {s.source_accepted}" if s.source_accepted else ""), file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    from . import SpecConfig

    path = Path(args.file) if args.file else Path(__file__).parent / "decode" / "verify.py"
    if not path.is_file():
        raise UsageError(f"file not found: {str(path)!r} (--file: a text file to rewrite)")
    code = path.read_text(encoding="utf-8", errors="replace")
    check_device(args.device)
    engine = _make_engine(args)
    prompt = (f"Apply this change to `{path.name}`:\n\n{args.instruction}\n\nCurrent contents of `{path.name}`:\n"
              f"```\n{code}\n```\n\nReply with the complete updated file and nothing else.")
    ids = engine.encode(prompt)
    print(f"rewriting {path} ({len(ids)} prompt tokens, up to {args.max_tokens} new tokens)", flush=True)
    engine.generate(ids, max_tokens=8, spec=None)  # warm up
    plain = engine.generate(ids, max_tokens=args.max_tokens, spec=None)
    print(f"  plain decoding : {plain.stats.completion_tokens} tokens, {plain.stats.tokens_per_second:6.1f} tok/s", flush=True)
    spec = engine.generate(ids, max_tokens=args.max_tokens, spec=SpecConfig())
    s = spec.stats
    print(f"  speculative    : {s.completion_tokens} tokens, {s.tokens_per_second:6.1f} tok/s "
          f"(MAT {s.mean_acceptance_length:.2f}, {s.steps} steps)")
    same = plain.token_ids == spec.token_ids
    speedup = s.tokens_per_second / max(plain.stats.tokens_per_second, 1e-9)
    print(f"  speedup {speedup:.2f}x, outputs identical: {same}")
    print("---- output (first 30 lines) ----")
    print("\n".join(spec.text.splitlines()[:30]))
    return 0 if same else 1


def _tcp_address(value: str) -> str:
    host, _, port = value.rpartition(":")
    try:
        n = int(port)
    except ValueError:
        n = -1
    if not 0 < n < 65536:
        raise argparse.ArgumentTypeError(f"--tcp wants [HOST:]PORT with a port in 1..65535, got {value!r}")
    return f"{host or '127.0.0.1'}:{n}"


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status. Output into a pipe that closed early (``agentspec stats
    --json | head``) ends the command quietly with 141 (128 + SIGPIPE, as a shell reports a
    command the pipe's signal ended), no traceback."""
    try:
        return _main(argv)
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        return 141


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader is gone (poll: POLLERR on its write end; where poll
    is missing, assumed); if so it now points at /dev/null, so the interpreter's flush at exit
    has nowhere to fail (Python's documented recipe for SIGPIPE)."""
    import os
    import select

    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    if hasattr(select, "poll"):
        p = select.poll()
        p.register(fd, select.POLLOUT)
        if not any(ev & select.POLLERR for _, ev in p.poll(0)):
            return False   # stdout is fine: the broken pipe was another one
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
    return True


def _main(argv: list[str] | None) -> int:
    from .errors import AgentSpecError

    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "demo":
            return cmd_demo(args)
        if args.command == "index":
            return cmd_index(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "stats":
            return cmd_stats(args)
        if args.command == "cache":
            return cmd_cache(args)
        if args.command == "lsp":
            from .lsp.server import main as lsp_main

            defaults = {k: v for k, v in (("url", args.url), ("model", args.model), ("config", args.config)) if v}
            token = os.environ.get("AGENTSPEC_LSP_TOKEN") or None
            if args.tcp and token is None:
                from .server import is_loopback

                host = args.tcp.rpartition(":")[0]
                if not is_loopback(host.strip("[]")):
                    raise UsageError(f"--tcp {args.tcp}: listening beyond loopback needs a token: set "
                                     "$AGENTSPEC_LSP_TOKEN (each peer sends it as initializationOptions.token), "
                                     "or listen on 127.0.0.1")
            return lsp_main(tcp=args.tcp, defaults=defaults, token=token)
        if args.command == "train-eagle3":
            from .training.cli import cmd_train_eagle3

            check_device(args.device)
            return cmd_train_eagle3(args)
    except (UsageError, AgentSpecError) as e:   # bad input: flags, files, config, model, device
        print(f"agentspec {args.command}: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:   # a run-time failure that ends the command with its message (port in use, ...)
        if isinstance(e.code, str):
            print(e.code if e.code.startswith("agentspec ") else f"agentspec {args.command}: {e.code}",
                  file=sys.stderr)
            return 1
        raise
    except BrokenPipeError:
        raise   # main(): 141, quietly
    except OSError as e:   # a failure while running (the OS refused a file, a socket, ...)
        print(f"agentspec {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
