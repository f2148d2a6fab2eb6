"""Recorded traffic as token streams, for teacher-forced replay (shared by replay.py and peers).

Each record of ``<data>/<name>.jsonl`` (``--data``; by default the sample in benchmarks/data)
becomes ``(id, prompt_ids, response_ids)``: the prompt rendered with the bundled model's chat
template (as the engine would see it) and the response tokenized as plain text, both with the
bundled model's tokenizer. Tokenized streams are cached as one ``.npz`` (``tokens`` int32
concatenated, ``offsets`` int64 [prompt_start, response_start, end] per record, ``ids``) under
``~/.cache/agentspec/replay`` and are read by the peer runners in other virtual environments,
which need only numpy.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import numpy as np

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import DATA, DATA_HELP  # noqa: E402

DATASETS = ("file_rewrites", "agent_turns")


def cache_path(data_dir: Path, name: str) -> Path:
    src = data_dir / f"{name}.jsonl"
    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}:{st.st_size}:{st.st_mtime_ns}:v1".encode()).hexdigest()[:12]
    root = Path(os.environ.get("AGENTSPEC_CACHE_DIR", Path.home() / ".cache" / "agentspec")) / "replay"
    return root / f"{name}-{key}.npz"


def tokenize(data_dir: Path, name: str, *, quiet: bool = False) -> Path:
    """Tokenize ``name`` once; return the path of the cached ``.npz``."""
    out = cache_path(data_dir, name)
    if out.exists():
        return out
    from agentspec.backends.embedded.weights import load_checkpoint
    from agentspec.traces import load_records, prompt_messages

    tok = load_checkpoint(quiet=True).tokenizer
    chunks, offsets, ids = [], [], []
    pos = 0
    records = list(load_records(data_dir / f"{name}.jsonl"))
    for k, rec in enumerate(records):
        p = tok.encode(tok.apply_chat_template(prompt_messages(rec["prompt"])))
        r = tok.encode(rec["response"])
        chunks += [np.asarray(p, np.int32), np.asarray(r, np.int32)]
        offsets.append((pos, pos + len(p), pos + len(p) + len(r)))
        pos += len(p) + len(r)
        ids.append(rec["id"])
        if not quiet and (k + 1) % 100 == 0:
            print(f"[replay_data] {name}: tokenized {k + 1}/{len(records)}", file=sys.stderr, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.npz")
    np.savez(tmp, tokens=np.concatenate(chunks), offsets=np.asarray(offsets, np.int64), ids=np.asarray(ids))
    os.replace(tmp, out)
    return out


def load(path: Path) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Records from a cached ``.npz``: ``(id, prompt_ids, response_ids)`` as int32 arrays."""
    z = np.load(path)
    toks, offs, ids = z["tokens"], z["offsets"], z["ids"]
    return [(str(ids[i]), toks[a:b], toks[b:c]) for i, (a, b, c) in enumerate(offs)]


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA, help=DATA_HELP)
    args = ap.parse_args()
    for name in DATASETS:
        path = tokenize(args.data, name)
        recs = load(path)
        print(name, path, len(recs), "records,",
              sum(len(p) for _, p, _ in recs), "prompt tokens,", sum(len(r) for _, _, r in recs), "response tokens")
