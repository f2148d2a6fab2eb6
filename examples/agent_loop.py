"""A real agent loop on a real repository, driven by the agentspec SDK.

Each turn: read a file, ask the model (in one session) for a short plan, apply the edit with
fast apply (the file is the draft source, so most of it is accepted from drafts), write it,
run a command on it, and feed the command's output back into the session. Per turn it prints
the client-side time to first token, tokens/s, MAT (mean acceptance length) and the prompt
tokens the server's prefix cache held.

    .venv/bin/python examples/agent_loop.py                  # bundled model, in this process
    .venv/bin/python examples/agent_loop.py --base-url http://127.0.0.1:8000   # a running server
    .venv/bin/python examples/agent_loop.py --repo DIR --turns 5

By default the loop works on a temporary copy of a few files of this repository; with
``--repo DIR`` on a temporary copy of DIR's Python files (the original is never written). An
edit that does not compile is rolled back, so a weak model cannot leave a broken file behind.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import agentspec  # noqa: E402

DEFAULT_FILES = ["agentspec/errors.py", "agentspec/_lazy.py", "agentspec/_cpu_env.py"]
TASKS = [
    "Add a one-line comment at the top of the file that says what the module is for.",
    "Add a short docstring to the first function or class that has none.",
    "Add a type annotation to one function parameter that has none.",
]
SYSTEM = "You are a careful coding agent. Answer in one short sentence."


def workspace(repo: Path | None, tmp: Path) -> list[Path]:
    """Copies of the files the loop edits, under ``tmp``."""
    if repo is None:
        files = [ROOT / f for f in DEFAULT_FILES]
        base = ROOT
    else:
        files = sorted(p for p in repo.rglob("*.py") if ".git" not in p.parts and p.stat().st_size < 6000)[:3]
        base = repo
        if not files:
            raise SystemExit(f"no Python files under 6 kB in {repo}")
    out = []
    for f in files:
        dst = tmp / f.relative_to(base)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dst)
        out.append(dst)
    return out


def run(cmd: list[str], cwd: Path) -> tuple[int, str]:
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=60)
    return p.returncode, (p.stdout + p.stderr).strip()


def stats(r) -> str:
    s = r.spec
    tps = s.tokens_per_second if s else 0.0
    mat = s.mean_acceptance_length if s else 0.0
    return f"{tps:6.1f} tok/s  MAT {mat:4.2f}  cached {r.usage.cached_tokens:4d}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, help="a repository to copy and work on (default: files of this one)")
    ap.add_argument("--base-url", help="a running `agentspec serve` (default: the embedded engine in-process)")
    ap.add_argument("--api-key")
    ap.add_argument("--turns", type=int, default=3)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="agentspec-loop-") as tmp_dir, \
            agentspec.Client(args.base_url, api_key=args.api_key) as client:
        tmp = Path(tmp_dir)
        files = workspace(args.repo, tmp)
        mode = args.base_url or "in-process"
        model = client.models()[0]["id"]   # in-process: loads the engine now, not inside turn 1's TTFT
        print(f"agent loop: {model} ({mode}); working copy {tmp}")
        t_start = time.perf_counter()
        with client.session(system=SYSTEM, temperature=0, max_tokens=40) as session:
            for turn in range(args.turns):
                path = files[turn % len(files)]
                rel = path.relative_to(tmp)
                task = TASKS[turn % len(TASKS)]
                head = "\n".join(path.read_text().splitlines()[:25])
                # 1. read the file, ask for a plan (streamed: TTFT measured here)
                stream = session.chat(f"File {rel} begins:\n```python\n{head}\n```\nTask: {task}\n"
                                      "What exactly will you change?", stream=True)
                plan = stream.final()
                # 2. propose and apply the edit; 3. write it (atomically, only if it changed)
                before = path.read_text()
                edit = session.rewrite(path, f"{task} Plan: {plan.text.strip()}", write=True, temperature=0)
                # 4. run a command; roll back an edit that breaks the file
                rc, out = run([sys.executable, "-m", "py_compile", str(rel)], tmp)
                if rc != 0 and edit.written:
                    path.write_text(before)
                    verdict = "py_compile failed: rolled back"
                else:
                    verdict = "py_compile ok" if rc == 0 else "py_compile failed"
                added = sum(1 for ln in edit.diff.splitlines() if ln.startswith("+") and not ln.startswith("+++"))
                removed = sum(1 for ln in edit.diff.splitlines() if ln.startswith("-") and not ln.startswith("---"))
                # 5. feed the observation back
                session.add("user", f"$ python -m py_compile {rel}\nexit code {rc}\n{out[-400:]}\n"
                                    f"Edit: +{added} -{removed} lines, {verdict}.")
                print(f"turn {turn + 1} {str(rel):24s} plan : TTFT {plan.ttft_ms:7.1f} ms  {stats(plan)}")
                print(f"       {'':24s} apply: TTFT {edit.result.spec.prefill_ms if edit.result.spec else 0:7.1f} ms"
                      f"  {stats(edit.result)}  +{added} -{removed}  {verdict}")
        print(f"{args.turns} turns in {time.perf_counter() - t_start:.1f} s (session {session.id})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
