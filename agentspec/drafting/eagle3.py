"""EAGLE-3 draft head in the SGLang 0.5.23 / SpecForge ``LlamaForCausalLMEagle3`` format.

Spec: ``docs/eagle3-format.md``. This module holds

- ``Eagle3Config``: the draft's ``config.json`` (``for_target``, ``to_json`` / ``from_json``);
- ``Eagle3Head``: the one-layer draft whose ``state_dict()`` keys are exactly the SGLang tensor
  names (``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``), so
  saving and loading are identity-mapped;
- ``save_eagle3`` / ``load_eagle3``: ``config.json`` + ``model.safetensors`` (bf16 weights, int64
  ``d2t``, bool ``t2d``), loading validated against the target's ``ModelArgs``;
- ``build_vocab_map``: SpecForge's draft-vocabulary selection (top-N ids, sorted ascending).

It imports torch, so ``agentspec.drafting`` does not import it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from suffix_index.atomic import fsync_dir, fsync_tree

from ..errors import ConfigError, ModelLoadError
from ..kernels.rope import apply_rope, rope_cos_sin

if TYPE_CHECKING:
    from ..backends.embedded.model import ModelArgs

__all__ = [
    "ARCHITECTURE",
    "Eagle3Config",
    "Eagle3Head",
    "Eagle3KV",
    "build_vocab_map",
    "default_feature_layers",
    "expected_shapes",
    "load_eagle3",
    "save_eagle3",
]

ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def default_feature_layers(n_layers: int) -> list[int]:
    """SpecForge / SGLang default aux-feature layer ids: ``[1, L//2 - 1, L - 4]`` (doc §3)."""
    return [1, n_layers // 2 - 1, n_layers - 4]


def _check_feature_layers(layers: Sequence[int], n_layers: int) -> str | None:
    """Why ``layers`` is not a usable ``eagle_aux_hidden_state_layer_ids`` list, or None.

    SGLang captures id ``i`` at the input of layer ``i + 1`` (= output of layer ``i``), so an id
    must lie in ``[0, L - 2]``; captures are concatenated in layer order, so the ids must be
    strictly increasing for the list order to be the ``fc`` input order; ``fc`` takes 3 of them.
    """
    layers = list(layers)
    if len(layers) != 3:
        return f"feature layers {layers}: expected 3 ids (fc takes 3 target hidden states)"
    if any(not isinstance(i, int) or isinstance(i, bool) for i in layers):
        return f"feature layers {layers}: ids must be integers"
    bad = [i for i in layers if not 0 <= i <= n_layers - 2]
    if bad:
        return f"feature layers {layers} out of range for a {n_layers}-layer target (valid 0..{n_layers - 2}): {bad}"
    if any(b <= a for a, b in zip(layers, layers[1:])):
        return f"feature layers {layers} must be strictly increasing (SGLang concatenates them in layer order)"
    return None


# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------

@dataclass
class Eagle3Config:
    """The draft's ``config.json`` fields (doc §2). Unknown keys survive in ``extra``."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int                      # target vocab V
    draft_vocab_size: int | None         # N
    feature_layers: list[int] | None     # eagle_config.eagle_aux_hidden_state_layer_ids
    architectures: list[str] = field(default_factory=lambda: [ARCHITECTURE])
    model_type: str = "llama"
    num_hidden_layers: int = 1
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    rope_scaling: dict | None = None
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def for_target(cls, args: ModelArgs, draft_vocab_size: int = 16384, layers: Sequence[int] | None = None,
                   *, bos_token_id: int | None = None, eos_token_id: int | None = None,
                   pad_token_id: int | None = None) -> "Eagle3Config":
        """A draft config matching ``args`` (draft hidden = target hidden, same attention shape)."""
        layers = default_feature_layers(args.n_layers) if layers is None else list(layers)
        why = _check_feature_layers(layers, args.n_layers)
        if why:
            raise ConfigError(why)
        if not 0 < draft_vocab_size <= args.vocab_size:
            raise ConfigError(f"draft_vocab_size {draft_vocab_size} must be in 1..{args.vocab_size} (target vocab)")
        return cls(
            hidden_size=args.dim, intermediate_size=args.hidden_dim,
            num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim,
            rms_norm_eps=float(args.norm_eps), rope_theta=float(args.rope_base),
            max_position_embeddings=args.max_seq_len, vocab_size=args.vocab_size,
            draft_vocab_size=int(draft_vocab_size), feature_layers=layers,
            bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        )

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("feature_layers", "extra")}
        out: dict[str, Any] = {"architectures": list(self.architectures), "model_type": self.model_type}
        out.update((k, v) for k, v in d.items() if k not in out)
        out["rope_theta"] = float(self.rope_theta)  # always written: SGLang defaults to 10000
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if out[k] is None:
                del out[k]
        out.update(self.extra)
        if self.feature_layers is not None:
            ec = dict(out.get("eagle_config") or {})
            ec["eagle_aux_hidden_state_layer_ids"] = list(self.feature_layers)
            out["eagle_config"] = ec
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Eagle3Config":
        d = dict(d)
        known = {f.name for f in fields(cls)} - {"feature_layers", "extra"}
        kw: dict[str, Any] = {}
        if "rope_theta" not in d:  # SGLang: rope_parameters["rope_theta"], else 10000
            rp = d.get("rope_parameters") or {}
            d["rope_theta"] = float(rp.get("rope_theta", 10000.0)) if isinstance(rp, dict) else 10000.0
        required = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"EAGLE-3 config.json lacks {missing}")
        d.setdefault("num_key_value_heads", d["num_attention_heads"])
        if d.get("head_dim") is None:
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        d.setdefault("rms_norm_eps", 1e-6)
        d.setdefault("max_position_embeddings", 2048)
        d.setdefault("draft_vocab_size", None)
        for k in list(d):
            if k in known:
                kw[k] = d.pop(k)
        ec = d.get("eagle_config") or {}
        layers = ec.get("eagle_aux_hidden_state_layer_ids") if isinstance(ec, dict) else None
        if isinstance(ec, dict) and "eagle_aux_hidden_state_layer_ids" in ec:
            rest = {k: v for k, v in ec.items() if k != "eagle_aux_hidden_state_layer_ids"}
            if rest:
                d["eagle_config"] = rest
            else:
                d.pop("eagle_config")
        return cls(**kw, feature_layers=None if layers is None else list(layers), extra=d)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Eagle3Config":
        try:
            d = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"EAGLE-3 config.json is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError("EAGLE-3 config.json must hold a JSON object")
        return cls.from_dict(d)


def expected_shapes(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """SGLang tensor name -> shape for ``config`` (doc §1 table, without the optional embedding)."""
    H, I = config.hidden_size, config.intermediate_size
    hd = config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    N = config.draft_vocab_size
    if N is None:
        raise ConfigError("draft_vocab_size is unset (full-vocab heads shared from the target are not supported)")
    return {
        "fc.weight": (H, 3 * H),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, q),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,),
        "lm_head.weight": (N, H),
        "d2t": (N,),
        "t2d": (config.vocab_size,),
    }


# --------------------------------------------------------------------------------------------
# the module
# --------------------------------------------------------------------------------------------

class _RMSNorm(nn.Module):
    """SpecForge ``LlamaRMSNorm``: normalise in float32, cast back, then scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dt)


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        H, hd = c.hidden_size, c.head_dim
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, hd
        self.q_proj = nn.Linear(2 * H, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, H, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        H, I = c.hidden_size, c.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.hidden_norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)


class Eagle3KV:
    """A per-request draft KV cache: keys/values ``[n_kv_heads, S, head_dim]``, appended to.

    ``truncate(n)`` drops everything after the first ``n`` slots (rejected draft tokens)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=1)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=1)
        return self.k, self.v

    def truncate(self, n: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :n], self.v[:, :n]


class Eagle3Head(nn.Module):
    """The EAGLE-3 draft (doc §4). ``state_dict()`` keys are the SGLang tensor names."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        if config.draft_vocab_size is None:
            raise ConfigError("draft_vocab_size is unset (full-vocab heads shared from the target are not supported)")
        self.config = config
        H, N, V = config.hidden_size, config.draft_vocab_size, config.vocab_size
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.midlayer = _MidLayer(config)
        self.norm = _RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, N, bias=False)
        self.register_buffer("d2t", torch.zeros(N, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool))
        if self.t2d.device.type != "meta":
            self.t2d[:N] = True  # identity map until set_vocab_map: draft id i = target id i

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def fuse(self, h_low: torch.Tensor, h_mid: torch.Tensor, h_high: torch.Tensor) -> torch.Tensor:
        """``fc([low ; mid ; high])``: the three target features (un-normalised residual streams of
        the feature layers, low to high) -> the draft's hidden input ``g``."""
        return self.fc(torch.cat([h_low, h_mid, h_high], dim=-1))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(self.config.rope_theta, self.config.head_dim, positions, device=self.fc.weight.device)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                kv: Eagle3KV | None = None, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step for T rows.

        embeds ``[T, H]``: the target embeddings of the input tokens; hidden ``[T, H]`` (the
        draft's own previous ``h2``) or ``[T, 3H]`` (target features, put through ``fc``);
        positions ``[T]``: RoPE positions. ``kv``: this request's draft cache; the rows' keys
        and values are appended to it. ``mask`` ``[T, len(kv) + T]`` bool (True = visible);
        None = every row sees the whole cache and the new rows up to itself (causal).
        Returns ``(draft_logits [T, N], h2 [T, H])``; ``h2`` (pre-final-norm) is the next step's
        ``hidden``.
        """
        H = self.config.hidden_size
        dt = self.fc.weight.dtype
        embeds, hidden = embeds.to(dt), hidden.to(dt)
        g = self.fc(hidden) if hidden.shape[-1] != H else hidden
        T = g.shape[0]
        m = self.midlayer
        u = torch.cat([m.input_layernorm(embeds), m.hidden_norm(g)], dim=-1)
        a = m.self_attn
        hd = a.head_dim
        cos, sin = self._rope(positions)
        q = apply_rope(a.q_proj(u).view(T, a.n_heads, hd).transpose(0, 1).float(), cos, sin).to(dt)
        k = apply_rope(a.k_proj(u).view(T, a.n_kv, hd).transpose(0, 1).float(), cos, sin).to(dt)
        v = a.v_proj(u).view(T, a.n_kv, hd).transpose(0, 1)
        past = 0
        if kv is not None:
            past = len(kv)
            k, v = kv.append(k, v)
        S = past + T
        if mask is None:
            mask = torch.ones(T, S, dtype=torch.bool, device=g.device)
            mask[:, past:] = torch.ones(T, T, dtype=torch.bool, device=g.device).tril()
        elif tuple(mask.shape) != (T, S):
            raise ValueError(f"mask shape {tuple(mask.shape)}, expected {(T, S)}")
        G = a.n_heads // a.n_kv
        kr, vr = k.repeat_interleave(G, dim=0), v.repeat_interleave(G, dim=0)   # query head h -> kv h // G
        scores = torch.matmul(q.float(), kr.float().transpose(1, 2)) / math.sqrt(hd)   # [Hq, T, S]
        scores = scores.masked_fill(~mask.to(g.device), float("-inf"))
        attn = torch.matmul(torch.softmax(scores, dim=-1), vr.float()).to(dt)          # [Hq, T, hd]
        h1 = g + a.o_proj(attn.transpose(0, 1).reshape(T, a.n_heads * hd))
        h2 = h1 + m.mlp(m.post_attention_layernorm(h1))
        logits = self.lm_head(self.norm(h2))
        return logits, h2

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target-vocab ids: ``draft_ids + d2t[draft_ids]``."""
        return draft_ids + self.d2t[draft_ids]


# --------------------------------------------------------------------------------------------
# vocab map
# --------------------------------------------------------------------------------------------

def build_vocab_map(token_counts: Mapping[int, int] | Sequence[int] | torch.Tensor, draft_vocab_size: int,
                    vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SpecForge ``process_token_dict_to_mappings`` (doc §5) -> ``(d2t int64 [N], t2d bool [V])``.

    ``token_counts``: per-target-id counts, either a sequence/tensor of length V or a mapping
    ``{target_id: count}`` (then ``vocab_size`` is required). The ``N`` most frequent ids are
    chosen (ties and unseen ids: lower id first, which matches SpecForge's padding with ids
    0, 1, 2, ... at count 0), sorted ascending; ``d2t[i] = chosen[i] - i``.
    """
    if isinstance(token_counts, Mapping):
        if vocab_size is None:
            raise ConfigError("build_vocab_map: vocab_size is required when token_counts is a mapping")
        counts = torch.zeros(vocab_size, dtype=torch.float64)
        for tid, c in token_counts.items():
            if not 0 <= int(tid) < vocab_size:
                raise ConfigError(f"build_vocab_map: token id {tid} outside the vocab 0..{vocab_size - 1}")
            counts[int(tid)] += float(c)
    else:
        counts = torch.as_tensor(token_counts).to(torch.float64).flatten()
        if vocab_size is not None and counts.numel() != vocab_size:
            raise ConfigError(f"build_vocab_map: {counts.numel()} counts for a vocab of {vocab_size}")
    V = counts.numel()
    N = int(draft_vocab_size)
    if not 0 < N <= V:
        raise ConfigError(f"build_vocab_map: draft_vocab_size {N} must be in 1..{V}")
    order = torch.sort(-counts, stable=True).indices     # descending count, lower id first on ties
    used = torch.sort(order[:N]).values.to(torch.int64)
    d2t = used - torch.arange(N, dtype=torch.int64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def _vocab_map_problem(d2t: torch.Tensor, t2d: torch.Tensor) -> str | None:
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        return f"d2t has dtype {d2t.dtype}, expected an integer dtype (int64)"
    if t2d.dtype != torch.bool:
        return f"t2d has dtype {t2d.dtype}, expected bool"
    N, V = d2t.numel(), t2d.numel()
    n_true = int(t2d.sum())
    if n_true != N:
        return f"t2d marks {n_true} target ids, expected draft_vocab_size {N}"
    ids = torch.arange(N, dtype=torch.int64) + d2t.to(torch.int64).cpu()
    if N and (int(ids.min()) < 0 or int(ids.max()) >= V):
        return f"d2t maps draft ids to target ids outside 0..{V - 1}"
    if N > 1 and not bool((ids[1:] > ids[:-1]).all()):
        return "d2t target ids (arange(N) + d2t) are not strictly increasing"
    if not bool(t2d.cpu()[ids].all()):
        return "d2t target ids are not the ids t2d marks"
    return None


# --------------------------------------------------------------------------------------------
# save / load
# --------------------------------------------------------------------------------------------

def save_eagle3(head: Eagle3Head, config: Eagle3Config, path: str | os.PathLike) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (float tensors bf16, ``d2t`` int64, ``t2d``
    bool, no embedding) to the directory ``path``, atomically: a sibling temp dir is renamed in."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in head.state_dict().items():
        if "embed" in name.lower():
            continue
        if name == "d2t":
            t = t.to(torch.int64)
        elif name == "t2d":
            t = t.to(torch.bool)
        elif t.is_floating_point():
            t = t.to(torch.bfloat16)
        tensors[name] = t.detach().to("cpu").contiguous()
    problem = _vocab_map_problem(tensors["d2t"], tensors["t2d"])
    if problem:
        raise ConfigError(f"refusing to save an inconsistent vocab map: {problem}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(config.to_json())
        fsync_tree(tmp)
        old = None
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.replace(path, old / path.name)
        os.replace(tmp, path)
        fsync_dir(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _normalise_name(name: str) -> str:
    """SGLang's accepted spellings -> ours: optional ``model.`` prefix, ``layers.0.`` = ``midlayer.``."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    return name


_REFUSED_KNOBS = ("fc_norm", "use_aux_norm", "norm_before_fc", "norm_output", "bias")


def _validate_config(config: Eagle3Config, target: ModelArgs) -> list[str]:
    errs = []
    if ARCHITECTURE not in (config.architectures or []):
        errs.append(f"architectures {config.architectures}: expected {[ARCHITECTURE]}")
    if config.hidden_size != target.dim:
        errs.append(f"hidden_size {config.hidden_size} != target hidden size {target.dim}")
    if config.vocab_size != target.vocab_size:
        errs.append(f"vocab_size {config.vocab_size} != target vocab size {target.vocab_size}")
    if config.draft_vocab_size is None:
        errs.append("draft_vocab_size is unset (full-vocab heads shared from the target are not supported)")
    elif not 0 < config.draft_vocab_size <= config.vocab_size:
        errs.append(f"draft_vocab_size {config.draft_vocab_size} not in 1..{config.vocab_size}")
    if config.num_hidden_layers != 1:
        errs.append(f"num_hidden_layers {config.num_hidden_layers}: only 1 is supported")
    if config.tie_word_embeddings:
        errs.append("tie_word_embeddings is true: an EAGLE-3 head with a draft vocab needs an untied lm_head")
    if config.hidden_act != "silu":
        errs.append(f"hidden_act {config.hidden_act!r}: only 'silu' is supported")
    if config.rope_scaling:
        errs.append(f"rope_scaling {config.rope_scaling}: not supported")
    if config.attention_bias:
        errs.append("attention_bias is true: not supported")
    if config.num_attention_heads % max(config.num_key_value_heads, 1):
        errs.append(f"num_attention_heads {config.num_attention_heads} is not a multiple of "
                    f"num_key_value_heads {config.num_key_value_heads}")
    ths = config.extra.get("target_hidden_size")
    if ths is not None and ths != target.dim:
        errs.append(f"target_hidden_size {ths} != target hidden size {target.dim}")
    nas = config.extra.get("num_aux_hidden_states")
    if nas is not None and nas != 3:
        errs.append(f"num_aux_hidden_states {nas}: only 3 is supported")
    for k in _REFUSED_KNOBS:
        if config.extra.get(k):
            errs.append(f"{k}={config.extra[k]!r}: not supported")
    if config.feature_layers is not None:
        why = _check_feature_layers(config.feature_layers, target.n_layers)
        if why:
            errs.append(why)
    return errs


def load_eagle3(path: str | os.PathLike, *, target_args: ModelArgs, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> tuple[Eagle3Head, Eagle3Config]:
    """Load an SGLang/SpecForge EAGLE-3 directory and check it fits the target ``target_args``.

    Raises ``ModelLoadError`` naming every mismatch found. Accepts ``model.``-prefixed and
    ``layers.0.`` names and ignores ``embed_tokens.weight`` (the target's embedding is used).
    A config without feature layer ids gets the default ``[1, L//2 - 1, L - 4]``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file, w_file = path / CONFIG_NAME, path / WEIGHTS_NAME
    if not cfg_file.is_file():
        raise ModelLoadError(f"EAGLE-3 checkpoint {path}: no {CONFIG_NAME}")
    if not w_file.is_file():
        raise ModelLoadError(f"EAGLE-3 checkpoint {path}: no {WEIGHTS_NAME}")
    try:
        config = Eagle3Config.from_json(cfg_file.read_text())
    except (ConfigError, TypeError, OSError) as e:
        raise ModelLoadError(f"EAGLE-3 checkpoint {path}: bad {CONFIG_NAME}: {e}") from None
    errs = _validate_config(config, target_args)
    if errs:
        raise ModelLoadError(f"EAGLE-3 checkpoint {path} does not fit the target: " + "; ".join(errs))
    if config.feature_layers is None:
        config.feature_layers = default_feature_layers(target_args.n_layers)
    try:
        raw = load_file(str(w_file))
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelLoadError(f"EAGLE-3 checkpoint {path}: cannot read {WEIGHTS_NAME}: {e}") from None
    tensors: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        n = _normalise_name(name)
        if n == "embed_tokens.weight":
            continue
        if n in tensors:
            raise ModelLoadError(f"EAGLE-3 checkpoint {path}: tensor {n} appears twice (as {name})")
        tensors[n] = t
    want = expected_shapes(config)
    missing = sorted(set(want) - set(tensors))
    unexpected = sorted(set(tensors) - set(want))
    wrong = [(n, want[n], tuple(t.shape)) for n, t in tensors.items() if n in want and tuple(t.shape) != want[n]]
    if missing:
        errs.append(f"missing tensors {missing}")
    if unexpected:
        errs.append(f"unexpected tensors {unexpected}")
    for n, exp, got in wrong:
        errs.append(f"tensor {n}: expected shape {list(exp)}, got {list(got)}")
    if not errs:
        problem = _vocab_map_problem(tensors["d2t"], tensors["t2d"])
        if problem:
            errs.append(f"inconsistent d2t/t2d: {problem}")
    if errs:
        raise ModelLoadError(f"EAGLE-3 checkpoint {path}: " + "; ".join(errs))
    head = Eagle3Head(config)
    sd = {n: (t.to(dtype) if t.is_floating_point() else t) for n, t in tensors.items()}
    sd["d2t"] = sd["d2t"].to(torch.int64)
    head.load_state_dict(sd, strict=True)
    head.to(device=device, dtype=dtype)  # floats only; buffers d2t/t2d keep their dtypes
    head.eval()
    return head, config
