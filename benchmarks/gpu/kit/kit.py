"""The GPU check kit's file work: staging on a machine with network, unpacking on the GPU machine.

    python benchmarks/gpu/kit/kit.py stage [--out build/gpu_kit] [--budget-mib N]
    python benchmarks/gpu/kit/kit.py check-size [--out build/gpu_kit] [--budget-mib N]
    python benchmarks/gpu/kit/kit.py stash --kit build/gpu_kit --state build/gpu_state
    python benchmarks/gpu/kit/kit.py assemble --kit ... --state ...     (-> the bundled GGUF)
    python benchmarks/gpu/kit/kit.py smoke-model --kit ... --out DIR    (random weights)
    python benchmarks/gpu/kit/kit.py hf-model --kit ... --gguf F --out DIR  (the bundled model)

What a run may bring is limited (64 MiB, counting the repository's own files), so the kit is cut
in parts, each carried by one run on the same machine (a warm machine keeps what earlier runs
left): ``base`` (SGLang's Python code for CPython 3.12 without its five Rust modules, xz-compressed;
the CPython 3.12 wheels SGLang imports at start-up and agentspec needs that the machine lacks; the
model's config and tokenizer; the tokenized prompts) and ``model.1``, ``model.2``, ... (the bundled
GGUF, xz-compressed and cut so that ``base + model.1`` and each later part fit a run). MANIFEST.json
in ``base`` lists every part with its size and sha256. ``check-size`` fails (exit 1) when a part
would not fit beside what the repository carries itself.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
MIB = 1 << 20
RUN_LIMIT = 64 * MIB           # what one run of the device may bring, the repository's own files included
MARGIN = 3 * MIB               # room for files added to the repository after staging
SGLANG_VERSION = "0.5.23"
# SGLang's compiled Rust modules are CPython 3.11 builds; a text-only Llama never needs them (the
# radix tree falls back to Python, the others load only with options this kit does not use)
DROP_SUFFIXES = (".so",)
DROP_DIRS = ("sglang/multimodal_gen", "sglang/test")   # diffusion serving and SGLang's own tests
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja", "special_tokens_map.json")


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def tree_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def travelling_bytes(root: Path = ROOT) -> int:
    """What a run carries besides the kit: tracked files and untracked files git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout
    total = 0
    for name in out.split(b"\0"):
        if name:
            p = root / os.fsdecode(name)
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
    return total


def part_budget(travel: int, limit: int = RUN_LIMIT, margin: int = MARGIN) -> int:
    """Bytes one run may carry in kit parts."""
    return limit - travel - margin


def plan_parts(base: int, model: int, budget: int) -> list[int]:
    """Sizes of the model's parts: the first rides with ``base``, each later one alone."""
    if base >= budget:
        raise ValueError(f"the kit's base part ({base / MIB:.1f} MiB) does not fit one run "
                         f"({budget / MIB:.1f} MiB left beside the repository's own files)")
    sizes, left, room = [], model, budget - base
    while left > 0:
        take = min(left, room)
        sizes.append(take)
        left -= take
        room = budget
    return sizes or [0]


def split_file(src: Path, sizes: list[int], dests: list[Path]) -> None:
    with open(src, "rb") as f:
        for size, dest in zip(sizes, dests):
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(dest, "wb") as out:
                left = size
                while left:
                    chunk = f.read(min(left, 1 << 20))
                    if not chunk:
                        raise ValueError(f"{src} is shorter than its planned parts")
                    out.write(chunk)
                    left -= len(chunk)
        if f.read(1):
            raise ValueError(f"{src} is longer than its planned parts")


# ---------------------------------------------------------------------------------------------
# staging (network: PyPI)
# ---------------------------------------------------------------------------------------------

def pip_download(args: list[str], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
           "-d", str(dest), *args]
    subprocess.run(cmd, check=True)


def wheel_requirements() -> list[str]:
    lines = (HERE / "wheels.txt").read_text().splitlines()
    return [x.split("#", 1)[0].strip() for x in lines if x.split("#", 1)[0].strip()]


def stage_sglang(cache: Path, base: Path) -> dict:
    wheels = sorted(cache.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not wheels:
        pip_download([f"sglang=={SGLANG_VERSION}"], cache)
        wheels = sorted(cache.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    wheel = wheels[0]
    out = base / "sglang.tar.xz"
    key = {"wheel": wheel.name, "wheel_sha256": sha256(wheel), "drop": [*DROP_SUFFIXES, *DROP_DIRS]}
    stamp = cache / "sglang.tar.xz.key"
    cached = cache / "sglang.tar.xz"
    if not (cached.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == key):
        import zipfile

        with tempfile.TemporaryDirectory() as tmp:
            with zipfile.ZipFile(wheel) as z:
                z.extractall(tmp)
            dropped = []
            for p in sorted(Path(tmp).rglob("*")):
                rel = p.relative_to(tmp).as_posix()
                if p.is_file() and (p.name.endswith(DROP_SUFFIXES) or rel.startswith(DROP_DIRS)):
                    dropped.append(rel)
                    p.unlink()
            for d in DROP_DIRS:
                shutil.rmtree(Path(tmp) / d, ignore_errors=True)
            key["dropped_files"] = len(dropped)
            with lzma.open(cached.with_suffix(".tmp"), "wb", preset=6) as xz:
                with tarfile.open(fileobj=xz, mode="w") as tar:
                    for p in sorted(Path(tmp).iterdir()):
                        tar.add(p, arcname=p.name)
        cached.with_suffix(".tmp").rename(cached)
        stamp.write_text(json.dumps(key))
    shutil.copy2(cached, out)
    return {"file": out.name, "from": wheel.name, "bytes": out.stat().st_size, "sha256": sha256(out)}


def stage_wheels(cache: Path, base: Path) -> list[dict]:
    wdir = cache / "wheels"
    reqs = wheel_requirements()
    stamp = wdir / ".requirements"
    if not (stamp.is_file() and stamp.read_text() == "\n".join(reqs)):
        shutil.rmtree(wdir, ignore_errors=True)
        wdir.mkdir(parents=True)
        platforms = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64",
                     "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                     "manylinux_2_5_x86_64", "manylinux1_x86_64", "any"]
        pip_download(["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                      *[a for p in platforms for a in ("--platform", p)], *reqs], wdir)
        stamp.write_text("\n".join(reqs))
    out = base / "wheels"
    out.mkdir()
    rows = []
    for w in sorted(wdir.glob("*.whl")):
        shutil.copy2(w, out / w.name)
        rows.append({"file": w.name, "bytes": w.stat().st_size})
    return rows


def stage_model_files(base: Path, python_model_dir: Path | None) -> dict:
    """config + tokenizer of the bundled model (for the smoke test's random weights and for the
    converted model on the GPU machine, so that it tokenizes as the prompts were tokenized here)."""
    out = base / "model_files"
    out.mkdir()
    src = python_model_dir
    made = None
    if src is None or not (src / "config.json").is_file():
        from agentspec.integrations.sglang.convert import convert

        made = Path(tempfile.mkdtemp()) / "hf"
        src = convert(made)
    files = {}
    for name in MODEL_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
            files[name] = sha256(out / name)
    weights = src / "model.safetensors"
    info = {"files": files, "weights_sha256": sha256(weights) if weights.is_file() else None}
    if made is not None:
        shutil.rmtree(made.parent, ignore_errors=True)
    return info


def stage_prompts(base: Path, rewrites: int, agent: int, max_prompt: int) -> dict:
    from agentspec.backends.embedded.engine import EmbeddedEngine
    from benchmarks.harness import DATA, agent_prompts, first_record, rewrite_prompts

    tok = EmbeddedEngine(quiet=True)
    sets = {"rewrites": rewrite_prompts(tok, DATA, rewrites, max_prompt, first_record(DATA, 200)),
            "agent": agent_prompts(tok, DATA, agent, max_prompt, first_record(DATA, 150))}
    (base / "prompts.json").write_text(json.dumps(sets))
    return {k: len(v) for k, v in sets.items()}


def stage(out: Path, budget_mib: float | None, rewrites: int, agent: int, max_prompt: int, model_dir: Path | None) -> dict:
    from agentspec.backends.embedded.weights import bundled_model_path

    cache = out.parent / (out.name + "_cache")
    cache.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    base = out / "base"
    base.mkdir(parents=True)
    manifest: dict = {"sglang_version": SGLANG_VERSION}
    manifest["sglang"] = stage_sglang(cache, base)
    manifest["wheels"] = stage_wheels(cache, base)
    manifest["model_files"] = stage_model_files(base, model_dir)
    manifest["prompts"] = stage_prompts(base, rewrites, agent, max_prompt)

    gguf = Path(bundled_model_path())
    packed = cache / (gguf.name + ".xz")
    key = cache / (gguf.name + ".xz.sha256-of-source")
    gguf_sha = sha256(gguf)
    if not (packed.is_file() and key.is_file() and key.read_text() == gguf_sha):
        with open(gguf, "rb") as src, lzma.open(packed.with_suffix(".tmp"), "wb", preset=6) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        packed.with_suffix(".tmp").rename(packed)
        key.write_text(gguf_sha)
    travel = travelling_bytes()
    budget = int(budget_mib * MIB) if budget_mib else part_budget(travel)
    base_bytes = tree_size(base) + 64 * 1024      # the manifest is written last
    sizes = plan_parts(base_bytes, packed.stat().st_size, budget)
    names = [f"model.{i + 1}" for i in range(len(sizes))]
    split_file(packed, sizes, [out / n / f"{gguf.name}.xz.{n}" for n in names])
    manifest["model"] = {"gguf": gguf.name, "gguf_bytes": gguf.stat().st_size, "gguf_sha256": gguf_sha,
                         "xz_sha256": sha256(packed),
                         "parts": [{"name": n, "file": f"{gguf.name}.xz.{n}", "bytes": s,
                                    "sha256": sha256(out / n / f"{gguf.name}.xz.{n}")} for n, s in zip(names, sizes)]}
    manifest["budget"] = {"run_limit": RUN_LIMIT, "repository_bytes_at_staging": travel, "margin": MARGIN,
                          "part_budget": budget}
    (base / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    return manifest


# ---------------------------------------------------------------------------------------------
# size check
# ---------------------------------------------------------------------------------------------

def runs(out: Path) -> list[list[str]]:
    """The parts each run carries: base with model.1, then each later model part alone."""
    models = sorted((p.name for p in out.glob("model.*") if p.is_dir()), key=lambda n: int(n.split(".")[1]))
    first = ["base"] + models[:1]
    return [first] + [[m] for m in models[1:]]


def check_size(out: Path, budget: int | None = None, travel: int | None = None) -> list[dict]:
    """Every run's carried bytes plus the repository's own must stay under the run limit."""
    if not (out / "base" / "MANIFEST.json").is_file():
        raise FileNotFoundError(f"{out}: no staged kit (run: python benchmarks/gpu/kit/kit.py stage)")
    travel = travelling_bytes() if travel is None else travel
    limit = RUN_LIMIT if budget is None else budget + travel
    rows = []
    for parts in runs(out):
        carried = sum(tree_size(out / p) for p in parts)
        shown = out.resolve().relative_to(ROOT).as_posix() if out.resolve().is_relative_to(ROOT) else out.as_posix()
        rows.append({"carry": [f"{shown}/{p}" for p in parts], "carried_bytes": carried,
                     "repository_bytes": travel, "total_bytes": carried + travel, "limit_bytes": limit,
                     "fits": carried + travel <= limit})
    return rows


# ---------------------------------------------------------------------------------------------
# on the GPU machine
# ---------------------------------------------------------------------------------------------

def manifest_of(kit: Path, state: Path) -> dict:
    for p in (kit / "base" / "MANIFEST.json", state / "MANIFEST.json"):
        if p.is_file():
            return json.loads(p.read_text())
    raise FileNotFoundError("no MANIFEST.json: the base part was never brought to this machine (run the smoke "
                            "step first, on the same machine)")


def stash(kit: Path, state: Path) -> dict:
    """Move the parts this run brought into ``state`` (which later runs on this machine keep),
    checking each against the manifest; report which model parts are still missing."""
    state.mkdir(parents=True, exist_ok=True)
    if (kit / "base" / "MANIFEST.json").is_file():
        for name in ("MANIFEST.json", "prompts.json"):
            shutil.copy2(kit / "base" / name, state / name)
        shutil.copytree(kit / "base" / "model_files", state / "model_files", dirs_exist_ok=True)
    manifest = manifest_of(kit, state)
    parts = state / "model_parts"
    parts.mkdir(exist_ok=True)
    have = []
    for part in manifest["model"]["parts"]:
        src = kit / part["name"] / part["file"]
        dst = parts / part["file"]
        if src.is_file() and not (dst.is_file() and sha256(dst) == part["sha256"]):
            if sha256(src) != part["sha256"]:
                raise ValueError(f"{src}: sha256 differs from the manifest (staged twice?)")
            shutil.copy2(src, dst)
        if dst.is_file():
            have.append(part["name"])
    missing = [p["name"] for p in manifest["model"]["parts"] if p["name"] not in have]
    return {"have": have, "missing": missing}


def assemble(kit: Path, state: Path) -> Path:
    manifest = manifest_of(kit, state)
    m = manifest["model"]
    gguf = state / m["gguf"]
    if gguf.is_file() and gguf.stat().st_size == m["gguf_bytes"] and sha256(gguf) == m["gguf_sha256"]:
        return gguf
    missing = stash(kit, state)["missing"]
    if missing:
        raise FileNotFoundError(f"model parts not on this machine yet: {missing} (carry them with "
                                "'bash benchmarks/gpu/kit/gpu_run.sh store')")
    tmp = gguf.with_suffix(".tmp")

    class Joined:
        def __init__(self, files):
            self.files, self.f = list(files), None

        def read(self, n=-1):
            while True:
                if self.f is None:
                    if not self.files:
                        return b""
                    self.f = open(self.files.pop(0), "rb")
                data = self.f.read(n)
                if data:
                    return data
                self.f.close()
                self.f = None

    joined = Joined(state / "model_parts" / p["file"] for p in m["parts"])
    with lzma.open(joined, "rb") as src, open(tmp, "wb") as dst:   # type: ignore[arg-type]
        shutil.copyfileobj(src, dst, 1 << 20)
    if sha256(tmp) != m["gguf_sha256"]:
        raise ValueError(f"{gguf.name}: the joined parts do not give back the staged file")
    tmp.rename(gguf)
    return gguf


def copy_model_files(kit: Path, state: Path, out: Path) -> None:
    src = kit / "base" / "model_files"
    if not src.is_dir():
        src = state / "model_files"
    for p in src.iterdir():
        shutil.copy2(p, out / p.name)


def smoke_model(kit: Path, state: Path, out: Path, seed: int = 0) -> Path:
    """A model of the bundled model's shape (its config and tokenizer) with random weights: the
    smoke test's target, before the real weights have arrived."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    copy_model_files(kit, state, tmp)
    cfg = AutoConfig.from_pretrained(tmp)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)
    copy_model_files(kit, state, tmp)   # save_pretrained rewrote config.json
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def hf_model(kit: Path, state: Path, gguf: Path, out: Path) -> dict:
    """The bundled model as SGLang loads it (agentspec.integrations.sglang.convert), with the
    staged tokenizer files; says whether the weights equal the ones converted at staging."""
    from agentspec.integrations.sglang.convert import convert

    if not (out / "model.safetensors").is_file():
        convert(out, gguf)
    manifest = manifest_of(kit, state)
    differ = [n for n, h in manifest["model_files"]["files"].items()
              if n != "config.json" and (out / n).is_file() and sha256(out / n) != h]
    copy_model_files(kit, state, out)
    want = manifest["model_files"].get("weights_sha256")
    got = sha256(out / "model.safetensors")
    return {"path": str(out), "weights_sha256": got, "same_weights_as_staging": want == got if want else None,
            "tokenizer_files_replaced": differ}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stage")
    s.add_argument("--out", type=Path, default=ROOT / "build" / "gpu_kit")
    s.add_argument("--budget-mib", type=float, help="bytes of kit one run may carry (default: 64 MiB less the "
                   "repository's own files less 1 MiB)")
    s.add_argument("--rewrites", type=int, default=8)
    s.add_argument("--agent", type=int, default=8)
    s.add_argument("--max-prompt", type=int, default=2000)
    s.add_argument("--model-dir", type=Path, default=ROOT / ".venv-sglang" / "models" / "SmolLM2-135M-Instruct",
                   help="the bundled model already converted (its config/tokenizer are copied; converted if absent)")
    c = sub.add_parser("check-size")
    c.add_argument("--out", type=Path, default=ROOT / "build" / "gpu_kit")
    for name in ("stash", "assemble", "smoke-model", "hf-model"):
        p = sub.add_parser(name)
        p.add_argument("--kit", type=Path, default=ROOT / "build" / "gpu_kit")
        p.add_argument("--state", type=Path, default=ROOT / "build" / "gpu_state")
        if name in ("smoke-model", "hf-model"):
            p.add_argument("--out", type=Path, required=True)
        if name == "hf-model":
            p.add_argument("--gguf", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.cmd == "stage":
        sys.path.insert(0, str(ROOT))
        manifest = stage(args.out, args.budget_mib, args.rewrites, args.agent, args.max_prompt, args.model_dir)
        print(json.dumps({k: manifest[k] for k in ("sglang", "prompts", "model", "budget")}, indent=1))
        args.cmd = "check-size"
    if args.cmd == "check-size":
        rows = check_size(args.out)
        for i, r in enumerate(rows, 1):
            print(f"[kit] run {i}: carry {r['carry']}: {r['carried_bytes'] / MIB:.1f} MiB + repository "
                  f"{r['repository_bytes'] / MIB:.1f} MiB = {r['total_bytes'] / MIB:.1f} MiB of "
                  f"{r['limit_bytes'] / MIB:.0f} MiB{'' if r['fits'] else '  TOO LARGE'}", file=sys.stderr)
        return 0 if all(r["fits"] for r in rows) else 1
    if args.cmd == "stash":
        print(json.dumps(stash(args.kit, args.state)))
    elif args.cmd == "assemble":
        print(assemble(args.kit, args.state))
    elif args.cmd == "smoke-model":
        print(smoke_model(args.kit, args.state, args.out))
    elif args.cmd == "hf-model":
        print(json.dumps(hf_model(args.kit, args.state, args.gguf, args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
