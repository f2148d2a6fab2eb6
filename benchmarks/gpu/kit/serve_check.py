"""``agentspec serve --backend sglang`` on the GPU, asked by the real ``openai`` client.

    python benchmarks/gpu/kit/serve_check.py --model DIR --out FILE [-- SERVE ARGS...]

Starts the server (SGLang engine in its process, the CUDA stand-in's Triton attention, arguments
after ``--`` passed on), waits for ``/health``, then: a greedy chat completion, the same request
streamed (its text must equal the first), ``/v1/apply`` (fast apply: the merged file must hold the
update is recorded; that it answers is checked), and ``/metrics``. Writes a JSON record (times, token counts, acceptance, the checks) and
exits 1 if a check failed or the server did not come up.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

CODE = '''def add(a, b):
    return a + b


def sub(a, b):
    return a - b
'''
UPDATE = '''def add(a: int, b: int) -> int:
    return a + b
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--log", type=Path, help="the server's output (default: beside --out)")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("serve_args", nargs="*")
    args = ap.parse_args(argv)
    import httpx
    import openai

    port = free_port()
    log_path = args.log or args.out.with_suffix(".log")
    cmd = [sys.executable, "-P", "-m", "agentspec", "serve", "--backend", "sglang", "--model", args.model, "--port", str(port),
           "--insecure-no-auth", *args.serve_args]
    record: dict = {"command": cmd, "checks": {}}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    ok = False
    try:
        deadline = time.monotonic() + args.ready_timeout
        with httpx.Client(timeout=5.0) as http:
            while time.monotonic() < deadline and server.poll() is None:
                try:
                    if http.get(f"{base}/health").status_code == 200:
                        ok = True
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        record["ready_s"] = round(time.perf_counter() - t0, 1)
        record["checks"]["server ready"] = ok
        if not ok:
            record["exit_code"] = server.poll()
            return finish(record, args.out, 1)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        msgs = [{"role": "user", "content": "Rewrite in Python 3 with type hints:\n" + CODE}]
        t = time.perf_counter()
        r = client.chat.completions.create(model="x", messages=msgs, temperature=0, max_tokens=128)
        record["chat"] = {"seconds": round(time.perf_counter() - t, 3), "completion_tokens": r.usage.completion_tokens,
                          "finish_reason": r.choices[0].finish_reason, "text": r.choices[0].message.content}
        record["checks"]["chat answered"] = bool(r.choices[0].message.content)
        t = time.perf_counter()
        streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
            model="x", messages=msgs, temperature=0, max_tokens=128, stream=True) if ch.choices)
        record["stream"] = {"seconds": round(time.perf_counter() - t, 3)}
        record["checks"]["stream equals chat (greedy)"] = streamed == r.choices[0].message.content
        t = time.perf_counter()
        with httpx.Client(timeout=120.0) as http:
            a = http.post(f"{base}/v1/apply", json={"code": CODE, "update": UPDATE})
            record["apply"] = {"status": a.status_code, "seconds": round(time.perf_counter() - t, 3)}
            body = a.json() if a.headers.get("content-type", "").startswith("application/json") else {}
            merged = body.get("merged_code") or ""
            record["apply"].update(usage=body.get("usage"), spec=body.get("spec"), merged_code=merged)
            # a 135M model may merge badly: that it answers is checked, what it merged is recorded
            record["checks"]["apply answered"] = a.status_code == 200 and bool(merged)
            record["apply"]["kept_the_rest_and_took_the_update"] = "def sub(a, b)" in merged and "-> int" in merged
            m = http.get(f"{base}/metrics")
            record["checks"]["metrics"] = m.status_code == 200
            record["metrics_has_spec_decode"] = "spec_decode" in m.text
        return finish(record, args.out, 0 if all(record["checks"].values()) else 1)
    except Exception as e:  # noqa: BLE001 - recorded, then the exit code says it
        record["error"] = f"{type(e).__name__}: {e}"
        return finish(record, args.out, 1)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


def finish(record: dict, out: Path, code: int) -> int:
    record["ok"] = code == 0
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k in ("ok", "ready_s", "checks", "error")}))
    return code


if __name__ == "__main__":
    sys.exit(main())
