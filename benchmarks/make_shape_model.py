#!/usr/bin/env python
"""A GGUF file of a real model's shape with random weights, made the way a user's file is made.

For timing a model size no installable file has (Qwen2.5-Coder-7B: 28 layers, 3584 wide, 28
query / 4 kv heads of 128, MLP 18944, vocabulary 152064): its Hugging Face folder is written with
transformers' config and random float16 tensors (normal, std 0.02; norms 1) in safetensors
shards, the tokenizer taken from a real GGUF file of the same family (``--tokenizer-from``, e.g.
the Qwen2.5-Coder 1.5B file of ``scripts/fetch_model.py``), then converted with llama.cpp's own
``convert_hf_to_gguf.py`` (float16) and quantized with its ``llama-quantize`` (``--type``,
default Q4_K_M), both from the tree ``benchmarks/peers/setup_llamacpp.sh`` builds. Random weights
give random text: a file for speed and memory, not for output. Prints the file's path.

    python -m benchmarks.make_shape_model --shape qwen2.5-7b \\
        --tokenizer-from "$(python scripts/fetch_model.py qwen2.5-coder-1.5b)" --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import logger  # noqa: E402

log = logger("make_shape_model")

# Hugging Face Qwen2 configs of the published models (config.json), by shape name
SHAPES = {
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=False),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=True),
}
SHARD_BYTES = 2 << 30


def tensors(c: dict):
    """(name, shape) of every tensor of a Qwen2 checkpoint with config ``c``."""
    d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = d // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    yield "model.embed_tokens.weight", (v, d)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (d,)
        yield p + "self_attn.q_proj.weight", (d, d)
        yield p + "self_attn.q_proj.bias", (d,)
        yield p + "self_attn.k_proj.weight", (kv, d)
        yield p + "self_attn.k_proj.bias", (kv,)
        yield p + "self_attn.v_proj.weight", (kv, d)
        yield p + "self_attn.v_proj.bias", (kv,)
        yield p + "self_attn.o_proj.weight", (d, d)
        yield p + "post_attention_layernorm.weight", (d,)
        yield p + "mlp.gate_proj.weight", (f, d)
        yield p + "mlp.up_proj.weight", (f, d)
        yield p + "mlp.down_proj.weight", (d, f)
    yield "model.norm.weight", (d,)
    if not c["tie_word_embeddings"]:
        yield "lm_head.weight", (v, d)


def write_folder(shape: str, tokenizer_from: Path, folder: Path, seed: int) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

    c = SHAPES[shape]
    folder.mkdir(parents=True, exist_ok=True)
    transformers.Qwen2Config(**c, torch_dtype="float16", architectures=["Qwen2ForCausalLM"]).save_pretrained(folder)
    log(f"tokenizer from {tokenizer_from}")
    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_from.parent), gguf_file=tokenizer_from.name)
    tok.save_pretrained(folder)
    g = torch.Generator().manual_seed(seed)
    shard: dict = {}
    size = n = 0
    weight_map: dict = {}
    total = 0

    def flush():
        nonlocal shard, size, n
        if shard:
            name = f"model-{n + 1:05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            log(f"  {name}: {size / 2**30:.2f} GiB")
            shard, size, n = {}, 0, n + 1

    for name, shp in tensors(c):
        if len(shp) == 1:
            t = torch.ones(shp, dtype=torch.float16) if name.endswith("norm.weight") else \
                (torch.randn(shp, generator=g) * 0.02).to(torch.float16)
        else:
            t = torch.empty(shp, dtype=torch.float16)
            for r in range(0, shp[0], 4096):   # float32 randoms a slab at a time
                t[r:r + 4096] = (torch.randn((min(4096, shp[0] - r), shp[1]), generator=g) * 0.02).to(torch.float16)
        shard[name] = t
        size += t.numel() * 2
        total += t.numel() * 2
        if size >= SHARD_BYTES:
            flush()
    flush()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b")
    ap.add_argument("--tokenizer-from", type=Path, required=True, help="a GGUF file of the family (its tokenizer)")
    ap.add_argument("--out", type=Path, required=True, help="folder for the file (and, while it runs, the float16 copies)")
    ap.add_argument("--type", default="Q4_K_M", help="llama-quantize type (default Q4_K_M)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the Hugging Face folder and the float16 GGUF")
    args = ap.parse_args()
    if not args.tokenizer_from.is_file():
        ap.error(f"--tokenizer-from is not a file: {str(args.tokenizer_from)!r} (python scripts/fetch_model.py --list)")
    import importlib.util

    if importlib.util.find_spec("sentencepiece") is None:   # llama.cpp's converter imports it for Qwen2
        raise SystemExit("llama.cpp's convert_hf_to_gguf.py needs sentencepiece: pip install 'sentencepiece<0.3'")
    setup = Path(__file__).resolve().parent / "peers" / "setup_llamacpp.sh"
    r = subprocess.run(["bash", str(setup)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"llama.cpp setup failed: {r.stderr[-2000:]}")
    bin_dir = Path(r.stdout.strip().splitlines()[-1]).parent
    tree = bin_dir.parents[1]
    out = args.out / f"{args.shape}-random-{args.type}.gguf"
    if out.is_file():
        print(out)
        return 0
    hf, f16 = args.out / f"{args.shape}-hf", args.out / f"{args.shape}-random-F16.gguf"
    if not (hf / "model.safetensors.index.json").is_file():
        log(f"writing {hf} (random float16 weights)")
        write_folder(args.shape, args.tokenizer_from, hf, args.seed)
    log(f"converting with {tree / 'convert_hf_to_gguf.py'}")
    if not f16.is_file():
        # the converter imports its own modules from beside it (benchmarks/ sets PYTHONSAFEPATH)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
        subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(hf), "--outtype", "f16",
                        "--outfile", str(f16)], check=True, env=env, cwd=str(tree))
    log(f"quantizing to {args.type} with llama-quantize")
    subprocess.run([str(bin_dir / "llama-quantize"), str(f16), str(out), args.type, str(os.cpu_count() or 1)],
                   check=True)
    if not args.keep:
        shutil.rmtree(hf)
        f16.unlink()
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
