"""Soak: a real server under hours (here: minutes) of mixed traffic from misbehaving clients.

One ``agentspec serve`` (the bundled model) with 3 tenants, each with its own API key and its own
workspace folder, which a script edits during the run. ``--clients`` concurrent clients (default
16) for ``--minutes`` (default 10) send a random mix: chat greedy and sampled, completions, fast
apply (code and workspace path), streaming, streams cancelled mid-way, requests over the context
window (400), bad bodies (400), a wrong key (401), and hostile probes, each with the answer it
must get: a server-owned file through ``/v1/apply`` (the config file sits in one tenant's workspace,
``log_dir`` in another's: 403), a body nested 100,000 levels deep (400), a ``text/plain`` body (415),
another tenant's session (404), and bursts of 8 requests from one tenant (a flood). Sampled every
few seconds: the server's RSS, the prefix cache's bytes, requests running and waiting.

Reported (JSON on stdout, a plot with ``--plot``): requests by kind and status, 5xx count,
latency and TTFT p50/p99 per minute, RSS and cache bytes over time (growth after warm-up), and
the acceptance logs checked against the responses: every request that the server answered (200,
a stream's end, a cancelled stream) has exactly one log record with its id, and no record is
there twice; each probe's answers against the one it must get (``probes``), and TTFT per tenant.

    .venv/bin/python -m benchmarks.soak --minutes 10 --clients 16 --plot benchmarks/results/soak.png \\
        --out benchmarks/results/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import ROOT, emit_report, logger, machine_record, pyplot, save_figure, start_server  # noqa: E402

TENANTS = {"alpha": "sk-alpha-soak-0001", "beta": "sk-beta-soak-00002", "gamma": "sk-gamma-soak-0003"}
MODULE = '''def total(items):
    """Sum of the items' prices."""
    return sum(item.price for item in items)


def average(items):
    if not items:
        return 0.0
    return total(items) / len(items)
'''


# long contexts for agent turns: real source files of this repository (each well over 256 tokens)
CONTEXTS = [(ROOT / "agentspec" / name).read_text()[:3000] for name in
            ("backends/embedded/prefix_cache.py", "api/limits.py", "workspace/workspace.py", "telemetry/sink.py", "config.py", "apply.py")
            if (ROOT / "agentspec" / name).exists()]


log = logger("soak")

# the hostile probes and the status each must get (session_probe: 404 once another tenant has one)
PROBES = {"apply_owned": 403, "nested": 400, "text_plain": 415, "session_probe": 404, "flood": 200}


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)


class Soak:
    def __init__(self, base: str, workspaces: dict[str, Path], seed: int, max_tokens: int) -> None:
        self.base, self.workspaces, self.max_tokens = base, workspaces, max_tokens
        self.rng = random.Random(seed)
        self.results: list[dict] = []      # kind, status, tenant, latency, ttft, t, request id
        self.sessions: dict[str, str] = {}  # tenant -> a session id it created (probed by the others)
        self.t0 = time.monotonic()

    def _headers(self, tenant: str, bad: bool = False) -> dict:
        return {"Authorization": f"Bearer {'sk-not-a-real-key-xx' if bad else TENANTS[tenant]}"}

    async def one(self, http: httpx.AsyncClient) -> None:
        rng = self.rng
        tenant = rng.choice(list(TENANTS))
        kind = rng.choices(["chat", "chat_sampled", "completion", "apply_code", "apply_path", "stream",
                            "stream_cancel", "too_long", "bad_body", "bad_key", "agent_turn",
                            "apply_owned", "nested", "text_plain", "session_probe", "flood"],
                           weights=[16, 10, 8, 10, 6, 14, 10, 8, 8, 6, 8, 4, 3, 3, 3, 2])[0]
        if kind in PROBES:
            return await self.probe(http, kind, tenant)
        mt = self.max_tokens
        url, body, stream = "/v1/chat/completions", None, False
        msgs = [{"role": "user", "content": rng.choice([
            "Write a Python function that reverses a string.", "What does `git rebase` do? One sentence.",
            "Explain the difference between a list and a tuple in Python.",
            f"Repeat this code exactly:\n{MODULE}"])}]
        if kind == "chat":
            body = {"messages": msgs, "max_tokens": mt, "temperature": 0}
        elif kind == "chat_sampled":
            body = {"messages": msgs, "max_tokens": mt, "temperature": 0.8, "seed": rng.randrange(1000)}
        elif kind == "agent_turn":   # a long shared context (> one prefix-cache chunk): fills and evicts the cache
            doc = rng.choice(CONTEXTS)
            body = {"messages": [{"role": "system", "content": f"You are a coding agent. The repository:\n{doc}"},
                                 {"role": "user", "content": rng.choice(["Summarize this code.", "Find one bug."])}],
                    "max_tokens": mt, "temperature": 0}
        elif kind == "completion":
            url, body = "/v1/completions", {"prompt": "def fibonacci(n):", "max_tokens": mt, "temperature": 0}
        elif kind == "apply_code":
            url, body = "/v1/apply", {"code": MODULE, "update": "def average(items):\n    # guard empty input\n",
                                      "temperature": 0, "max_tokens": 160}
        elif kind == "apply_path":
            url, body = "/v1/apply", {"path": "src/shop.py", "instruction": "Add a docstring to average.",
                                      "temperature": 0, "max_tokens": 160}
        elif kind in ("stream", "stream_cancel"):
            body, stream = {"messages": msgs, "max_tokens": mt * 2, "temperature": 0, "stream": True}, True
        elif kind == "too_long":
            body = {"messages": [{"role": "user", "content": "token " * 12000}], "max_tokens": 8}
        elif kind == "bad_body":
            body = rng.choice([{"messages": "not a list"}, {"messages": [], "max_tokens": -3},
                               {"prompt": None}, {"messages": [{"role": "user"}], "temperature": "hot"}])
        headers = self._headers(tenant, bad=kind == "bad_key")
        if kind == "bad_key":
            body = {"messages": msgs, "max_tokens": 4}
        t = time.monotonic()
        rec = {"kind": kind, "tenant": tenant, "t": round(t - self.t0, 2), "ttft": None, "id": None}
        try:
            if stream:
                async with http.stream("POST", url, json=body, headers=headers) as r:
                    rec["status"] = r.status_code
                    n = 0
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        ev = json.loads(line[6:])
                        rec["id"] = rec["id"] or ev.get("id")
                        if "error" in ev:
                            rec["stream_error"] = ev["error"].get("code")
                        if rec["ttft"] is None and any((c.get("delta") or {}).get("content") for c in ev.get("choices") or []):
                            rec["ttft"] = time.monotonic() - t
                        n += 1
                        if kind == "stream_cancel" and n >= 3:
                            rec["cancelled"] = True
                            break   # leaving the block closes the connection mid-stream
            else:
                r = await http.post(url, json=body, headers=headers)
                rec["status"] = r.status_code
                if r.status_code == 200:
                    rec["id"] = r.json().get("id")
                else:
                    err = r.json().get("error") or {}
                    rec["error_code"] = err.get("code")
        except httpx.HTTPError as e:
            rec["status"] = -1
            rec["exception"] = repr(e)
        rec["latency"] = time.monotonic() - t
        self.results.append(rec)

    async def probe(self, http: httpx.AsyncClient, kind: str, tenant: str) -> None:
        """A hostile probe, recorded with the status it must get (``expected``)."""
        headers = self._headers(tenant)
        t = time.monotonic()
        rec = {"kind": kind, "tenant": tenant, "t": round(t - self.t0, 2), "ttft": None, "id": None,
               "expected": PROBES[kind]}
        try:
            if kind == "apply_owned":   # alpha's workspace holds log_dir, beta's the config file
                path = {"alpha": "logs/alpha.jsonl", "beta": "soak.toml"}.get(tenant, "../ws-beta/soak.toml")
                r = await http.post("/v1/apply", headers=headers, json={"path": path, "instruction": "Repeat it.",
                                                                        "max_tokens": 8})
            elif kind == "nested":
                body = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b', "max_tokens": 4}'
                r = await http.post("/v1/completions", content=body,
                                    headers={**headers, "Content-Type": "application/json"})
            elif kind == "text_plain":
                r = await http.post("/v1/chat/completions", headers={**headers, "Content-Type": "text/plain"},
                                    content=json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
            elif kind == "session_probe":   # another tenant's session: unknown to this one
                others = [sid for t_, sid in self.sessions.items() if t_ != tenant]
                own = await http.post("/v1/sessions", headers=headers, json={})
                if own.status_code == 200:
                    self.sessions[tenant] = own.json()["id"]
                r = (await http.get(f"/v1/sessions/{others[0]}", headers=headers)) if others else own
                rec["expected"] = 404 if others else 200
            else:   # flood: 8 at once from one tenant
                rs = await asyncio.gather(*(http.post("/v1/completions", headers=headers, json={
                    "prompt": "def fibonacci(n):", "max_tokens": self.max_tokens, "temperature": 0}) for _ in range(8)))
                for x in rs:
                    if x.status_code == 200:
                        self.results.append({"kind": "flood_member", "tenant": tenant, "t": rec["t"], "ttft": None,
                                             "id": x.json().get("id"), "status": 200,
                                             "latency": time.monotonic() - t})
                r = rs[0]
                rec["statuses"] = sorted(x.status_code for x in rs)
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["error_code"] = (r.json().get("error") or {}).get("code")
        except httpx.HTTPError as e:
            rec["status"] = -1
            rec["exception"] = repr(e)
        rec["latency"] = time.monotonic() - t
        self.results.append(rec)

    async def client(self, http: httpx.AsyncClient, stop: float) -> None:
        while time.monotonic() < stop:
            await self.one(http)

    async def edit_workspaces(self, stop: float) -> int:
        """Edits each tenant's workspace: rewrite a file, create and delete one, every ~2 s."""
        k = 0
        while time.monotonic() < stop:
            for name, ws in self.workspaces.items():
                (ws / "src" / "shop.py").write_text(MODULE.replace("0.0", f"{k}.0"))
                scratch = ws / "src" / f"scratch_{k % 5}.py"
                if scratch.exists():
                    scratch.unlink()
                else:
                    scratch.write_text(f"CANARY_{name.upper()}_{k} = {k}\n")
            k += 1
            await asyncio.sleep(2.0)
        return k

    async def sample(self, http: httpx.AsyncClient, pid: int, stop: float, every: float, out: list) -> None:
        while time.monotonic() < stop:
            row = {"t": round(time.monotonic() - self.t0, 1), "rss": rss_bytes(pid)}
            try:
                h = (await http.get("/health")).json()
                row.update(running=h.get("running"), waiting=h.get("waiting"), index_bytes=h.get("index_bytes"),
                           prefix_cache_bytes=h.get("prefix_cache_bytes"))
            except (httpx.HTTPError, ValueError):
                pass
            out.append(row)
            await asyncio.sleep(every)


def serve(tmp: Path, workspaces: dict[str, Path], prefix_cache_mb: int):
    """The soak server: a tenant per key with its own workspace; its acceptance logs in alpha's
    workspace and its config file in beta's (server-owned paths inside workspaces: probed)."""
    logs = workspaces["alpha"] / "logs"
    cfg = workspaces["beta"] / "soak.toml"
    lines = [f"[server]\nlog_dir = {json.dumps(str(logs))}\nprefix_cache_bytes = {prefix_cache_mb * 2**20}\n"]
    for name, key in TENANTS.items():
        lines.append(f"[[tenants]]\nname = \"{name}\"\napi_keys = [\"{key}\"]\nworkspace = {json.dumps(str(workspaces[name]))}\n")
    cfg.write_text("\n".join(lines))
    return start_server(["--config", str(cfg)], log_path=tmp / "server.log"), logs


def check_logs(logs: Path, results: list[dict]) -> dict:
    records = collections.Counter()
    for f in logs.glob("*.jsonl*"):
        for line in f.read_text().splitlines():
            if line.strip():
                records[json.loads(line)["request_id"]] += 1
    answered = {r["id"] for r in results if r.get("id") and r.get("status") == 200}
    missing = sorted(answered - set(records))
    extra = sorted(set(records) - answered)
    dup = sorted(k for k, n in records.items() if n > 1)
    return {"records": sum(records.values()), "answered_with_id": len(answered), "missing": len(missing),
            "duplicated": len(dup), "records_without_a_response": len(extra), "missing_ids": missing[:10],
            "extra_ids": extra[:10]}


def rss_summary(samples: list[dict], warmup_s: float) -> dict:
    """RSS after warm-up: first and last sample, max, and growth as the median of the last minute's
    samples minus the median of the first minute's after warm-up (one sample is noisy: a batch's
    activations come and go); the same for the suffix index and the prefix cache."""
    after = [s for s in samples if s["t"] >= warmup_s and s["rss"]]
    if not after:
        return {}
    mb = 2**20
    first = [s for s in after if s["t"] < after[0]["t"] + 60]
    last = [s for s in after if s["t"] > after[-1]["t"] - 60]
    out = {"warmup_s": warmup_s, "first_after_warmup_mb": round(after[0]["rss"] / mb, 1),
           "last_mb": round(after[-1]["rss"] / mb, 1), "max_mb": round(max(s["rss"] for s in after) / mb, 1),
           "growth_after_warmup_mb": round((statistics.median(s["rss"] for s in last)
                                            - statistics.median(s["rss"] for s in first)) / mb, 1)}
    for key in ("index_bytes", "prefix_cache_bytes"):
        vals = [s.get(key) for s in after if s.get(key) is not None]
        if vals:
            out[f"{key}_first_mb"] = round(vals[0] / mb, 2)
            out[f"{key}_last_mb"] = round(vals[-1] / mb, 2)
            out[f"{key}_max_mb"] = round(max(vals) / mb, 2)
    return out


def summarize(results: list[dict], samples: list[dict], minutes: float, warmup_s: float) -> dict:
    by_kind = collections.defaultdict(collections.Counter)
    for r in results:
        by_kind[r["kind"]][str(r["status"])] += 1
    status = collections.Counter(str(r["status"]) for r in results)
    per_min = []
    for m in range(int(minutes + 0.999)):
        rows = [r for r in results if m * 60 <= r["t"] < (m + 1) * 60 and r["status"] == 200]
        lat = [r["latency"] for r in rows]
        ttft = [r["ttft"] for r in rows if r["ttft"] is not None]
        per_min.append({"minute": m, "served": len(rows), "latency_p50": quantile(lat, 0.5),
                        "latency_p99": quantile(lat, 0.99), "ttft_p50": quantile(ttft, 0.5),
                        "ttft_p99": quantile(ttft, 0.99)})
    rss = rss_summary(samples, warmup_s)
    probes = {}
    for r in results:
        if "expected" in r:
            p = probes.setdefault(r["kind"], {"sent": 0, "as_expected": 0, "other": collections.Counter()})
            p["sent"] += 1
            ok = r["status"] == r["expected"] and all(s_ == 200 for s_ in r.get("statuses", [200]))
            p["as_expected"] += ok
            if not ok:
                p["other"][str(r["status"])] += 1
    per_tenant = {}
    for tenant in sorted({r["tenant"] for r in results}):
        ttft = [r["ttft"] for r in results if r["tenant"] == tenant and r["ttft"] is not None and r["status"] == 200]
        per_tenant[tenant] = {"streams": len(ttft), "ttft_p50": quantile(ttft, 0.5), "ttft_p99": quantile(ttft, 0.99)}
    return {"requests": len(results), "by_status": dict(status), "probes": probes, "ttft_by_tenant": per_tenant,
            "server_errors_5xx": sum(
        n for s, n in status.items() if s.startswith("5")), "connection_errors": status.get("-1", 0),
        "stream_errors": collections.Counter(r.get("stream_error") for r in results if r.get("stream_error")),
        "by_kind": {k: dict(v) for k, v in by_kind.items()}, "per_minute": per_min, "rss": rss}


def plot(path: Path, results: list[dict], samples: list[dict], summary: dict) -> None:
    fig, ax = pyplot().subplots(3, 1, figsize=(9, 9), sharex=True)
    t = [s["t"] / 60 for s in samples]
    ax[0].plot(t, [s["rss"] / 2**20 for s in samples], label="server RSS (MiB)")
    for key, label in (("prefix_cache_bytes", "prefix cache (MiB)"), ("index_bytes", "suffix index (MiB)")):
        vals = [s.get(key) for s in samples]
        if any(v is not None for v in vals):
            ax[0].plot(t, [(v or 0) / 2**20 for v in vals], label=label)
    ax[0].set_ylabel("MiB")
    ax[0].legend()
    ax[1].plot(t, [s.get("running") or 0 for s in samples], label="running")
    ax[1].plot(t, [s.get("waiting") or 0 for s in samples], label="waiting")
    ax[1].set_ylabel("requests")
    ax[1].legend()
    pm = summary["per_minute"]
    x = [p["minute"] + 0.5 for p in pm]
    for key in ("latency_p50", "latency_p99", "ttft_p50", "ttft_p99"):
        ax[2].plot(x, [p[key] for p in pm], marker="o", label=key.replace("_", " "))
    ax[2].set_ylabel("seconds")
    ax[2].set_xlabel("minutes")
    ax[2].legend()
    fig.suptitle(f"soak: {summary['requests']} requests, {summary['server_errors_5xx']} 5xx")
    save_figure(fig, path, dpi=110)


async def run(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        workspaces = {}
        for name in TENANTS:
            ws = tmp / f"ws-{name}"
            (ws / "src").mkdir(parents=True)
            (ws / "src" / "shop.py").write_text(MODULE)
            (ws / ".gitignore").write_text("*.log\n")
            workspaces[name] = ws
        server, logs = serve(tmp, workspaces, args.prefix_cache_mb)
        log(f"server up on {server.port}; {args.clients} clients for {args.minutes} min")
        soak = Soak(server.base, workspaces, args.seed, args.max_tokens)
        samples: list[dict] = []
        stop = time.monotonic() + args.minutes * 60
        limits = httpx.Limits(max_connections=args.clients + 4)
        try:
            async with httpx.AsyncClient(base_url=soak.base, timeout=args.request_timeout, limits=limits) as http:
                tasks = [asyncio.create_task(soak.client(http, stop)) for _ in range(args.clients)]
                edits = asyncio.create_task(soak.edit_workspaces(stop))
                sampler = asyncio.create_task(soak.sample(http, server.pid, stop, args.sample_every, samples))
                await asyncio.gather(*tasks, sampler)
                n_edits = await edits
        finally:
            code = server.stop(60)
        summary = summarize(soak.results, samples, args.minutes, args.warmup)
        # the server's start-up lines: its model, dtype, kernels and hardware ("model ready ...")
        startup = [ln for ln in (tmp / "server.log").read_text(errors="replace").splitlines()
                   if ln.startswith("[agentspec]") and any(w in ln for w in ("loaded", "model ready", "serving"))]
        out = {"machine": machine_record(server=tmp / "server.log"), "server_startup": startup, "clients": args.clients, "minutes": args.minutes,
               "max_tokens": args.max_tokens, "prefix_cache_mb": args.prefix_cache_mb, "workspace_edit_rounds": n_edits, "server_exit_code": code,
               "summary": summary, "logs": check_logs(logs, soak.results), "samples": samples}
        if args.plot:
            plot(args.plot, soak.results, samples, summary)
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=float, default=120.0, help="seconds before RSS growth is counted")
    ap.add_argument("--sample-every", type=float, default=5.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefix-cache-mb", type=int, default=192,
                    help="[server] prefix_cache_bytes: small, so the cache fills and evicts during the run")
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    out = asyncio.run(run(args))
    s = out["summary"]
    log(f"{s['requests']} requests, by status {s['by_status']}, 5xx {s['server_errors_5xx']}, RSS {s['rss']}, "
        f"logs {out['logs']}")
    emit_report(out, args.out, indent=1, default=str)
    probes_ok = all(p["sent"] == p["as_expected"] for p in s["probes"].values())
    return 0 if (s["server_errors_5xx"] == 0 and not out["logs"]["missing"] and not out["logs"]["duplicated"]
                 and probes_ok) else 1


if __name__ == "__main__":
    sys.exit(main())
