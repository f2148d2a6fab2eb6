"""What the benchmark scripts share, in one place.

- paths: the repository, the data (``--data``; by default the small sample shipped in
  ``benchmarks/data``, see its README), the tests' held-in fixture, the peer runners;
- ``logger``: a script's ``[name] message`` lines on stderr;
- the machine record: ``machine_record`` (CPU, flags, ISA level, cores, threads, kernel plan,
  dtype, versions: what every results file carries under ``"machine"``); ``rss_bytes``;
- JSON out: ``emit_report`` prints a report and writes it (atomically) to ``--out``;
- a server for a benchmark's client side: ``start_server`` runs ``agentspec serve`` on a free
  loopback port and waits for ``/health``; ``sse_events`` reads a streamed response;
- peers: ``run_peer`` runs a ``benchmarks/peers`` runner under another venv's python;
- workloads: the recorded prompts the scripts share (held-out rewrites, agent turns,
  multi-turn conversations) and the record each starts at (``first_record``);
- plots: matplotlib without a display, and the per-method bar chart.

Scripts import it as ``from benchmarks.harness import ...``. Run them from the repository root as
``python -m benchmarks.<script>``; ``python benchmarks/<script>.py`` works too (each script then
puts the repository root on ``sys.path`` first, the same two lines in every script).

Module-level imports are the standard library only: the scripts run under other interpreters
too (``.venv-sglang``), and ``--help`` loads nothing heavy.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "benchmarks" / "data"                             # a small held-out sample, shipped (its README)
DATA = SAMPLE                                                     # --data default; --data DIR: the full recorded sets
DATA_HELP = ("folder with file_rewrites.jsonl and agent_turns.jsonl (default: the small sample in benchmarks/data; "
             "give the full recorded sets for figures worth quoting)")
FIXTURE = ROOT / "tests" / "fixtures" / "file_rewrites_sample.jsonl"   # held in: the tests use these records
PEERS = ROOT / "benchmarks" / "peers"                             # runners for other venvs' pythons


def logger(name: str) -> Callable[[str], None]:
    """``log(msg)``: one ``[name] msg`` line on stderr, flushed."""

    def log(msg: str) -> None:
        print(f"[{name}] {msg}", file=sys.stderr, flush=True)

    return log


_log = logger("harness")


# --- the machine record ---------------------------------------------------------------------------

def machine_info() -> dict:
    """CPU, flags, kernel ISA (a server started from here runs the same ones: same machine, same
    environment)."""
    from agentspec.kernels import cpu_isa

    cpu_isa.apply_env()
    return cpu_isa.machine_info()


TORCH_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")
RECORD_KEYS = ("cpu", "flags", "isa", "cpus", "threads", "kernel_plan", "dtype", "versions")   # in every record


def machine_record(engine=None, *, kernels: dict | None = None, server: Server | Path | str | None = None,
                   peers: dict | None = None) -> dict:
    """The machine record every results file carries under ``"machine"`` (``RECORD_KEYS`` at least):
    the CPU model and the flags the kernels care about, the ISA level the native kernels run at,
    the cores (``cpus``: the machine's; ``cpus_usable``: this process's), ``threads``, the
    ``kernel_plan`` and ``dtype``, torch's ISA caps (``torch_env``) and ``versions``.

    The kernels and dtype come from where the model ran: ``engine`` (in this process: its
    ``kernel_info()``, the plan as a dict), ``kernels`` (an engine's ``kernel_info()`` from another
    process, or ``server_kernels()``), or ``server`` (an ``agentspec serve`` child, a ``Server`` or
    its log file: the plan as its "model ready" line prints it); with none of them (a benchmark
    that runs no model forward: drafters, indexes) they are None. ``peers``: the peers' builds as
    their runners reported them (``run_peer(..., builds=)``), under ``versions``."""
    import torch

    rec: dict = {"cpus": os.cpu_count(), **machine_info(), "threads": torch.get_num_threads(),
                 "kernel_plan": None, "dtype": None}
    if engine is not None:
        kernels = engine.kernel_info()   # threads, thread governor, dtype, KV dtype, the plan
        device = getattr(engine, "device", None)
        if device is not None and getattr(device, "type", "cpu") == "cuda":
            rec["gpu"] = torch.cuda.get_device_name(device)
    elif server is not None:
        kernels = server_kernels(server.log_path if isinstance(server, Server) else Path(server))
    rec.update(kernels or {})
    rec["torch_env"] = {k: os.environ.get(k) for k in TORCH_ENV}
    rec["versions"] = versions(peers)
    return rec


def server_kernels(log_path: Path) -> dict:
    """What an ``agentspec serve`` ran, from its log: ``model_ready`` (the whole "model ready"
    line), ``kernel_plan`` (its "kernels at ISA: ..." part) and ``dtype``; None where the line is
    missing (a server that did not get that far, another backend)."""
    import re

    text = Path(log_path).read_text(errors="replace") if Path(log_path).exists() else ""
    ready = [ln for ln in text.splitlines() if ln.startswith("[agentspec] model ready")]
    line = ready[-1] if ready else None
    plan = re.search(r"(kernels at .*)\), context", line or "")
    dtype = re.search(r"parameters, (\w+) on ", line or "")
    return {"model_ready": line, "kernel_plan": plan[1] if plan else None, "dtype": dtype[1] if dtype else None}


def versions(peers: dict | None = None) -> dict:
    """Python, torch and agentspec (its version and this checkout's commit, ``-dirty`` with
    uncommitted changes), and ``peers``' builds (``{"vllm": "0.32.0", ...}``)."""
    import platform

    import torch

    import agentspec

    out = {"python": platform.python_version(), "torch": torch.__version__, "agentspec": agentspec.__version__,
           "commit": _commit()}
    return {**out, **(peers or {})}


def _commit() -> str | None:
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


def rss_bytes() -> int:
    """This process's resident memory (Linux: ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --- JSON out -------------------------------------------------------------------------------------

def write_json(obj, path: Path, *, indent: int | None = 1, default=None) -> None:
    """``obj`` as JSON in ``path`` (its folder made), written beside it first and renamed over it,
    so an interrupted run never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=indent, default=default) + "\n")
    os.replace(tmp, path)


def emit_report(report: dict, out: Path | None = None, *, indent: int | None = 2, one_line: bool = False,
                default=None) -> None:
    """A benchmark's JSON report: written to ``out`` when given (``indent``), and printed: indented
    the same, or with ``one_line`` as the last line of stdout (what a parent process parses)."""
    if out:
        write_json(report, out, indent=indent, default=default)
    print(json.dumps(report, indent=None if one_line else indent, default=default), flush=True)


# --- a server for the client side -----------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """An ``agentspec serve`` child process on loopback; ``stop()`` (or leaving a ``with`` block)
    ends it. Its stdout and stderr go to ``log_path``."""

    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path, log_file) -> None:
        self.proc, self.port, self.log_path, self._log_file = proc, port, log_path, log_file
        self.base = f"http://127.0.0.1:{port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, chars: int = 3000) -> str:
        self._log_file.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, timeout: float = 30) -> int:
        """Terminate (kill after ``timeout`` seconds); the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._log_file.close()
        return code

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(args: list[str], *, log_path: Path, cwd: Path | None = None, timeout: float = 300) -> Server:
    """``python -m agentspec serve --port PORT *args`` on a free port, once ``/health`` answers 200.
    Exits (SystemExit, with the server's last output) if it dies or is not up in ``timeout`` s."""
    import httpx

    port = free_port()
    log_file = open(log_path, "w")  # noqa: SIM115 - the server writes it until it stops; Server.stop closes it
    proc = subprocess.Popen([sys.executable, "-m", "agentspec", "serve", "--port", str(port), *args], cwd=cwd,
                            stdout=log_file, stderr=subprocess.STDOUT)
    server = Server(proc, port, log_path, log_file)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(server.base + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            tail = server.log_tail()
            server.stop()
            raise SystemExit(f"server exited: {tail}")
        if time.monotonic() > deadline:
            tail = server.log_tail()
            server.stop()
            raise SystemExit(f"server did not start in {timeout:.0f} s: {tail}")
        time.sleep(0.2)


def sse_events(url: str, body: dict, timeout: float = 600) -> Iterator[dict]:
    """POST ``body`` to ``url`` and yield each streamed ``data: {...}`` event; an event with an
    ``error`` raises RuntimeError."""
    import httpx

    with httpx.stream("POST", url, json=body, timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(ev["error"])
            yield ev


# --- peers ----------------------------------------------------------------------------------------

def run_peer(python: str, runner: Path | str, spec: dict, timeout: int, *, builds: dict | None = None) -> dict | None:
    """A peer runner (``benchmarks/peers/<runner>``, or a path) under ``python`` with ``spec`` as its
    JSON file argument: the ``results`` of the JSON object on its last stdout line; None (logged)
    when it fails or times out. ``builds``: a dict that takes the versions the runner reports
    (its config's ``<name>_version`` keys, as ``name``), for ``machine_record(peers=builds)``."""
    runner = PEERS / runner if isinstance(runner, str) else runner
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
        spec_path = f.name
    try:
        r = subprocess.run([python, str(runner), spec_path], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        _log(f"{runner.name} timed out after {timeout}s")
        return None
    finally:
        os.unlink(spec_path)
    if r.returncode != 0:
        _log(f"{runner.name} failed (rc {r.returncode}): {r.stderr[-2000:]}")
        return None
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if builds is not None:
        builds.update({k.removesuffix("_version"): v for k, v in (out.get("config") or {}).items()
                       if k.endswith("_version")})
    return out["results"]


# --- workloads: recorded prompts ------------------------------------------------------------------

def first_record(data: Path, recorded: int, start: int | None = None) -> int:
    """The record a workload starts reading ``data`` at: ``start`` where given; else ``recorded``
    in the full recorded sets (their earlier records are those the tests and the drafters' tuning
    use), and 0 in the shipped sample (every record of it is held out)."""
    if start is not None:
        return start
    return 0 if is_sample(data) else recorded


def is_sample(data: Path) -> bool:
    """Whether ``data`` is the shipped sample (``SAMPLE``), not a folder of full recorded sets."""
    return Path(data).resolve() == SAMPLE.resolve()


def fixture_ids() -> set[str]:
    """The ids of the recorded rewrites the tests use (``FIXTURE``): held in, never a benchmark prompt."""
    return {json.loads(line)["id"] for line in FIXTURE.read_text().splitlines() if line.strip()}


def select_prompts(engine, data: Path, n: int, max_prompt: int, start: int) -> list[tuple[str, list[int]]]:
    """File-rewrite prompts not used by the tests, in file order from record ``start``."""
    from agentspec.traces import load_records, prompt_messages

    held = fixture_ids()
    out = []
    for k, rec in enumerate(load_records(data / "file_rewrites.jsonl")):
        if k < start or rec["id"] in held:
            continue
        ids = engine.encode(prompt_messages(rec["prompt"]))
        if len(ids) <= max_prompt:
            out.append((rec["id"], ids))
        if len(out) == n:
            break
    return out


def cold(engine) -> None:
    """Empty ``engine``'s prefix cache before a timed run: a run after another over the same
    prompts would otherwise take their prefill from the cache, so runs compared in one sitting
    (plain against speculation, one peer against another) would not pay the same prefill."""
    pc = getattr(engine, "prefix_cache", None)
    if pc is not None:
        pc.clear()


def distinct(prompts: list, n: int, log: Callable[[str], None] | None = None, *,
             key: Callable[[Any], Any] | None = None) -> list:
    """The first ``n`` prompts whose ``key`` differs (default: the prompt itself, as a tuple when a
    list of token ids), never one twice: a prompt repeated in a run would have its answer drafted
    from its first copy's output (the suffix index keeps the tenant's outputs) and its prefill
    taken from the cache. Fewer when fewer exist (said through ``log``)."""
    key = key or (lambda p: tuple(p) if isinstance(p, list) else p)
    seen, out = set(), []
    for p in prompts:
        k = key(p)
        if k not in seen:
            seen.add(k)
            out.append(p)
    if n > len(out) and log is not None:
        log(f"{n} requests asked, {len(out)} distinct prompts: running {len(out)}")
    return out[:n]


def rewrite_prompts(engine, data: Path, n: int, max_prompt: int, start: int) -> list[list[int]]:
    """``select_prompts``' token ids."""
    return [ids for _, ids in select_prompts(engine, data, n, max_prompt, start)]


def agent_items(data: Path, n: int, max_prompt: int, start: int, tokenizer) -> list[dict]:
    """Agent turns as chat messages: the system message plus the latest messages within ``max_prompt`` tokens."""
    from agentspec.traces import load_records, prompt_messages

    out = []
    for i, r in enumerate(load_records(data / "agent_turns.jsonl")):
        if i < start:
            continue
        msgs = prompt_messages(r["prompt"])
        head, tail = msgs[:1], []
        for m in reversed(msgs[1:]):
            if len(tokenizer.encode(tokenizer.apply_chat_template(head + [m] + tail))) > max_prompt:
                break
            tail.insert(0, m)
        if tail:
            out.append({"id": r["id"], "messages": head + tail})
        if len(out) == n:
            break
    return out


def agent_prompts(engine, data: Path, n: int, max_prompt: int, start: int) -> list[list[int]]:
    """Agent turns: the system message plus the most recent messages that fit ``max_prompt``
    tokens (the recorded histories run to ~10k tokens, past what this CPU can prefill quickly)."""
    return [engine.encode(it["messages"]) for it in agent_items(data, n, max_prompt, start, engine.tokenizer)]


def workload_prompts(engine, data: Path, workloads: str, n: int, max_prompt: int) -> dict[str, list[list[int]]]:
    """``{workload: token ids}`` for a comma-separated list of ``rewrites`` / ``agent_turns``, ``n``
    prompts each from their held-out records (``first_record``); SystemExit names a bad one."""
    sets: dict[str, list[list[int]]] = {}
    for wl in workloads.split(","):
        if wl == "rewrites":
            sets[wl] = rewrite_prompts(engine, data, n, max_prompt, first_record(data, 200))
        elif wl == "agent_turns":
            sets[wl] = agent_prompts(engine, data, n, max_prompt, first_record(data, 150))
        else:
            raise SystemExit(f"unknown workload {wl!r}: rewrites or agent_turns")
    return sets


def trajectories(path: Path, turns: int):
    """Each recorded task's first ``turns`` requests, in file order, for the tasks that have that
    many: ``(task, [messages of request 1, ..., of request turns])``, request k being the system
    prompt, the task and the first k-1 recorded assistant turns with their observations (a recorded
    history split into its successive turns)."""
    from agentspec.traces import conversation_turns, load_records, prompt_messages

    seen = set()
    for rec in load_records(path):
        task = rec["id"].split("#")[0]
        if task in seen:
            continue
        seen.add(task)
        msgs = conversation_turns(prompt_messages(rec["prompt"]))[:turns]
        if len(msgs) == turns:
            yield task, msgs


def conversations(path: Path, engine, *, tasks: int, turns: int, max_prompt: int) -> list[tuple[str, list]]:
    """The first ``tasks`` trajectories with ``turns`` turns whose prompts stay under ``max_prompt``
    (``engine.encode(messages)`` gives a turn's token ids)."""
    out = []
    for task, msgs in trajectories(path, turns):
        prompts = [engine.encode(m) for m in msgs]
        if len(prompts[-1]) > max_prompt:
            continue
        out.append((task, prompts))
        if len(out) == tasks:
            break
    return out


# --- plots ----------------------------------------------------------------------------------------

def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def method_bars(ax, names: list[str], values: list[float], *, labels: dict[str, str], ours: Callable[[str], bool],
                fmt: str) -> None:
    """Horizontal bars, one per method, top to bottom in ``names`` order, each labelled with its
    value (``fmt``); ours blue, peers grey."""
    colors = ["tab:blue" if ours(n) else "tab:gray" for n in names]
    bars = ax.barh([labels.get(n, n) for n in names], values, color=colors)
    ax.bar_label(bars, labels=[fmt.format(v) for v in values], padding=3)
    ax.invert_yaxis()


def save_figure(fig, path: Path, dpi: int = 120) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
