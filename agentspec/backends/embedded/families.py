"""Model families the embedded engine serves, and how a checkpoint's config becomes ``ModelArgs``.

Every ``config.json`` / GGUF field that changes the math is either implemented here or refused
with an error naming it: a field the engine does not know is never silently ignored.

| family (``model_type``) | what differs from Llama |
|---|---|
| ``llama`` (1, 2, 3.x) | rope scaling ``llama3`` / ``linear`` / ``yarn`` / ``dynamic``; tied embeddings on the small ones |
| ``mistral`` | a sliding window (the context is capped at it, so the window never cuts) |
| ``qwen2`` (Qwen2, Qwen2.5, Qwen2.5-Coder) | biases on q/k/v |
| ``qwen3`` (dense) | RMSNorm over each head of q and k; explicit ``head_dim`` |
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ...errors import ModelLoadError
from ...kernels import rope
from .model import ModelArgs

__all__ = ["FAMILIES", "GGUF_ARCHS", "args_from_gguf", "args_from_hf_config"]

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
GGUF_ARCHS = ("llama", "qwen2", "qwen3")

# config.json fields that never change the math: metadata, training-only or generation defaults
_HARMLESS = {
    "transformers_version", "architectures", "output_hidden_states", "return_dict", "dtype", "torch_dtype",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type", "initializer_range",
    "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "_name_or_path", "model_type",
    "output_attentions", "attention_dropout", "pretraining_tp", "tokenizer_class", "prefix", "task_specific_params",
    "tf_legacy_loss", "pruned_heads", "torchscript", "use_bfloat16", "finetuning_task", "sep_token_id",
    "decoder_start_token_id", "cross_attention_hidden_size", "add_cross_attention", "is_decoder",
    "_attn_implementation_autoset", "bad_words_ids", "begin_suppress_tokens", "diversity_penalty", "do_sample",
    "early_stopping", "encoder_no_repeat_ngram_size", "exponential_decay_length_penalty", "forced_bos_token_id",
    "forced_eos_token_id", "length_penalty", "max_length", "min_length", "no_repeat_ngram_size",
    "num_beam_groups", "num_beams", "num_return_sequences", "output_scores", "remove_invalid_values",
    "repetition_penalty", "return_dict_in_generate", "suppress_tokens", "temperature", "top_k", "top_p",
    "typical_p", "tie_encoder_decoder", "max_window_layers", "unk_token_id", "_model_name_or_path",
    "_attn_implementation", "attn_implementation", "use_return_dict", "model_max_length",
}
# fields read below (each implemented, or checked and refused when it asks for what is not)
_READ = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "tie_word_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "attention_bias", "mlp_bias",
    "sliding_window", "use_sliding_window", "layer_types", "partial_rotary_factor", "quantization_config",
    "original_max_position_embeddings",
}


def _refuse(where: str, what: str) -> ModelLoadError:
    return ModelLoadError(f"{where}: {what}")


def _rope_from_hf(cfg: Mapping, where: str) -> tuple[float, dict]:
    """(rope_theta, scaling dict or {}) from ``rope_parameters`` (transformers 5) or
    ``rope_theta`` + ``rope_scaling`` (older configs)."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    if params and legacy and {k: v for k, v in legacy.items() if k != "type"} != {
            k: v for k, v in params.items() if k in legacy}:
        raise _refuse(where, f"rope_scaling {legacy!r} and rope_parameters {params!r} disagree")
    if not params:
        params = dict(legacy)
    if any(isinstance(v, Mapping) for v in params.values()):
        raise _refuse(where, f"per-layer rope_parameters are not supported: {sorted(params)}")
    theta = params.pop("rope_theta", None)
    theta = float(cfg.get("rope_theta", 10000.0) if theta is None else theta)
    kind = params.get("rope_type", params.get("type", "default"))
    params.pop("type", None)
    if kind not in rope.ROPE_TYPES:
        raise _refuse(where, f"rope type {kind!r} (rope_scaling / rope_parameters) is not supported; "
                             f"supported: {', '.join(rope.ROPE_TYPES)}")
    if params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) not in (None, 1, 1.0):
        raise _refuse(where, f"partial_rotary_factor {params.get('partial_rotary_factor', cfg.get('partial_rotary_factor'))!r}"
                             " is not supported (only full rotary embeddings)")
    params.pop("partial_rotary_factor", None)
    if kind == "default":
        extra = sorted(set(params) - {"rope_type"})
        if extra:
            raise _refuse(where, f"rope type 'default' with fields {extra} is not supported")
        return theta, {}
    known = {
        "linear": {"rope_type", "factor"},
        "dynamic": {"rope_type", "factor", "original_max_position_embeddings"},
        "llama3": {"rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
        "yarn": {"rope_type", "factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                 "original_max_position_embeddings", "truncate"},
    }[kind]
    unknown = sorted(set(params) - known)
    if unknown:
        raise _refuse(where, f"rope type {kind!r} with fields {unknown} is not supported (known: {sorted(known)})")
    params["rope_type"] = kind
    if kind in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings",
                          cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings")))
    if kind == "yarn" and params.get("factor") is None:
        params["factor"] = cfg["max_position_embeddings"] / params["original_max_position_embeddings"]
    required = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor")}[kind]
    for key in required:
        if params.get(key) is None:
            raise _refuse(where, f"rope type {kind!r} needs {key!r}")
    return theta, params


def args_from_hf_config(cfg: Mapping, where: str, *, log: Callable[[str], None] = lambda _m: None) -> ModelArgs:
    """``ModelArgs`` for a Hugging Face ``config.json`` of a supported family, or ModelLoadError
    naming the field (or model_type) the engine does not implement."""
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise _refuse(where, f"model_type {family!r} is not supported; supported: {', '.join(FAMILIES)}")
    unknown = sorted(set(cfg) - _HARMLESS - _READ)
    if unknown:
        raise _refuse(where, f"config fields {unknown} are not implemented by the embedded engine "
                             f"(model_type {family!r}); refusing rather than ignoring them")
    if cfg.get("quantization_config"):
        method = (cfg["quantization_config"] or {}).get("quant_method")
        raise _refuse(where, f"quantization_config (quant_method {method!r}) is not supported: use unquantized "
                             "safetensors or a GGUF file")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse(where, f"hidden_act {act!r} is not supported (SwiGLU with silu only)")
    if cfg.get("mlp_bias"):
        raise _refuse(where, "mlp_bias true is not supported")
    if cfg.get("attention_bias"):
        raise _refuse(where, "attention_bias true (biases on q/k/v/o) is not supported")
    n_heads = int(cfg["num_attention_heads"])
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    theta, scaling = _rope_from_hf(cfg, where)
    if scaling.get("rope_type") == "dynamic":
        # dynamic NTK equals the default rope up to max_position_embeddings tokens; past them
        # transformers re-derives the base per forward, which the engine does not: cap the context
        log(f"rope type 'dynamic': context capped at max_position_embeddings ({max_pos}), where it equals the default rope")
        scaling = {}
    # sliding windows: a window at least the context never cuts, so cap the context at it
    window = cfg.get("sliding_window")
    uses_window = family == "mistral" or bool(cfg.get("use_sliding_window"))
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        kinds = set(layer_types)
        if kinds - {"full_attention", "sliding_attention"}:
            raise _refuse(where, f"layer_types {sorted(kinds)} are not supported")
        uses_window = uses_window or "sliding_attention" in kinds
    if uses_window and window is not None and int(window) < max_pos:
        log(f"sliding window {window}: context capped at {window} tokens, where the window never cuts")
        max_pos = int(window)
    return ModelArgs(
        dim=int(cfg["hidden_size"]),
        n_layers=int(cfg["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        hidden_dim=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6 if family.startswith("qwen") else 1e-5)),
        rope_base=theta,
        max_seq_len=max_pos,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // n_heads),
        family=family,
        qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        rope_scaling=scaling,
    )


# GGUF metadata keys (after the ``{arch}.`` prefix) that change the math and are not implemented
_GGUF_REFUSED = ("attn_logit_softcapping", "final_logit_softcapping", "expert_count", "expert_used_count",
                 "attention.sliding_window_pattern", "rope.scaling.attn_factor", "attention.q_lora_rank",
                 "attention.kv_lora_rank", "embedding_scale", "residual_scale", "logit_scale")


def args_from_gguf(field: Callable[[str], object], tensor_names: set[str], where: str,
                   *, freq_factors: tuple[float, ...] = (), log: Callable[[str], None] = lambda _m: None) -> ModelArgs:
    """``ModelArgs`` from GGUF metadata (``field(key)`` -> value or None) of a supported arch."""
    arch = field("general.architecture")
    if arch not in GGUF_ARCHS:
        raise _refuse(where, f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHS)}")

    def a(key, default=None):
        v = field(f"{arch}.{key}")
        return default if v is None else v

    for key in _GGUF_REFUSED:
        v = a(key)
        if v not in (None, 0, 0.0):
            raise _refuse(where, f"GGUF field {arch}.{key} = {v!r} is not supported")
    n_heads = int(a("attention.head_count"))
    dim = int(a("embedding_length"))
    head_dim = int(a("attention.key_length", dim // n_heads))
    if int(a("attention.value_length", head_dim)) != head_dim:
        raise _refuse(where, f"GGUF value_length {a('attention.value_length')} != key_length {head_dim} is not supported")
    if int(a("rope.dimension_count", head_dim)) != head_dim:
        raise _refuse(where, f"GGUF rope.dimension_count {a('rope.dimension_count')} != head_dim {head_dim}: "
                             "partial rotary embeddings are not supported")
    tokens = field("tokenizer.ggml.tokens") or []
    max_pos = int(a("context_length", 2048))
    kind = a("rope.scaling.type")
    scaling: dict = {}
    if kind not in (None, "none"):
        factor = float(a("rope.scaling.factor", 1.0))
        if kind == "linear":
            scaling = {"rope_type": "linear", "factor": factor}
        elif kind == "yarn":
            orig = int(a("rope.scaling.original_context_length", max_pos))
            scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig}
            for src, dst in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
                if a(src) is not None:
                    scaling[dst] = float(a(src))
        else:
            raise _refuse(where, f"GGUF rope.scaling.type {kind!r} is not supported (linear, yarn; llama3 as rope_freqs)")
    window = a("attention.sliding_window")
    if window and int(window) < max_pos:
        log(f"sliding window {window}: context capped at {window} tokens, where the window never cuts")
        max_pos = int(window)
    family = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[arch]
    return ModelArgs(
        dim=dim,
        n_layers=int(a("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(a("attention.head_count_kv", n_heads)),
        hidden_dim=int(a("feed_forward_length")),
        vocab_size=int(a("vocab_size", len(tokens))),
        norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_base=float(a("rope.freq_base", 10000.0)),
        max_seq_len=max_pos,
        tie_embeddings="output.weight" not in tensor_names,
        head_dim=head_dim,
        family=family,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        rope_scaling=scaling,
        rope_freq_factors=freq_factors,
    )
