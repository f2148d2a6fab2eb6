"""EAGLE-3 draft head: SGLang/SpecForge checkpoint format (docs/eagle3-format.md), no model loading."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentspec.drafting.eagle3 import (
    Eagle3Config,
    Eagle3Head,
    Eagle3KV,
    build_vocab_map,
    load_eagle3,
    save_eagle3,
)
from agentspec.backends.embedded.model import ModelArgs
from agentspec.errors import ConfigError, ModelLoadError

TINY = ModelArgs(dim=32, n_layers=8, n_heads=4, n_kv_heads=2, hidden_dim=48, vocab_size=100,
                 norm_eps=1e-5, rope_base=100000.0, max_seq_len=256)
N_TINY = 40

SMOLLM2 = ModelArgs(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, hidden_dim=1536, vocab_size=49152,
                    norm_eps=1e-5, rope_base=100000.0, max_seq_len=8192, tie_embeddings=True)

# docs/eagle3-format.md §1, SmolLM2-135M with N = 16384
DOC_TABLE = {
    "fc.weight": (576, 1728),
    "midlayer.hidden_norm.weight": (576,),
    "midlayer.input_layernorm.weight": (576,),
    "midlayer.self_attn.q_proj.weight": (576, 1152),
    "midlayer.self_attn.k_proj.weight": (192, 1152),
    "midlayer.self_attn.v_proj.weight": (192, 1152),
    "midlayer.self_attn.o_proj.weight": (576, 576),
    "midlayer.post_attention_layernorm.weight": (576,),
    "midlayer.mlp.gate_proj.weight": (1536, 576),
    "midlayer.mlp.up_proj.weight": (1536, 576),
    "midlayer.mlp.down_proj.weight": (576, 1536),
    "norm.weight": (576,),
    "lm_head.weight": (16384, 576),
    "d2t": (16384,),
    "t2d": (49152,),
}


def _tiny_head(seed: int = 0) -> tuple[Eagle3Head, Eagle3Config]:
    torch.manual_seed(seed)
    cfg = Eagle3Config.for_target(TINY, draft_vocab_size=N_TINY)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    counts = torch.randint(0, 50, (TINY.vocab_size,))
    head.set_vocab_map(*build_vocab_map(counts, N_TINY))
    return head.eval(), cfg


def _spec_forge_tensors(cfg: Eagle3Config, *, seed: int = 1) -> dict[str, torch.Tensor]:
    """Tensors named and shaped as in the doc table, built by hand (not via Eagle3Head)."""
    g = torch.Generator().manual_seed(seed)
    H, I, N, V = cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = {
        "fc.weight": (H, 3 * H), "midlayer.hidden_norm.weight": (H,), "midlayer.input_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * H), "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * H), "midlayer.self_attn.o_proj.weight": (H, q),
        "midlayer.post_attention_layernorm.weight": (H,), "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H), "midlayer.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,), "lm_head.weight": (N, H),
    }
    t = {k: (torch.randn(s, generator=g) * 0.1).to(torch.bfloat16) for k, s in shapes.items()}
    used = torch.sort(torch.randperm(V, generator=g)[:N]).values
    t["d2t"] = used - torch.arange(N)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    t["t2d"] = t2d
    return t


def _spec_forge_config(cfg: Eagle3Config, **over) -> dict:
    d = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 100000.0,
        "max_position_embeddings": 256, "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "pretraining_tp": 1, "use_cache": True,
        "initializer_range": 0.02, "attention_dropout": 0.0, "mlp_bias": False,
    }
    d.update(over)
    return d


def _write_spec_forge(path, tensors: dict, config: dict) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))


# ---------------------------------------------------------------------------------------------

def test_smollm2_state_dict_matches_doc_table():
    cfg = Eagle3Config.for_target(SMOLLM2)
    with torch.device("meta"):
        head = Eagle3Head(cfg)
    sd = head.state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == DOC_TABLE
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert all(m.bias is None for m in head.modules() if isinstance(m, torch.nn.Linear))


def test_smollm2_config_matches_doc_example():
    d = json.loads(Eagle3Config.for_target(SMOLLM2, bos_token_id=1, eos_token_id=2, pad_token_id=2).to_json())
    doc = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": 576, "intermediate_size": 1536,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0, "rope_scaling": None, "max_position_embeddings": 8192,
        "vocab_size": 49152, "draft_vocab_size": 16384, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
        "attention_bias": False, "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]},
    }
    assert d == doc


def test_config_json_round_trip_keeps_unknown_keys():
    cfg = Eagle3Config.for_target(TINY, draft_vocab_size=N_TINY, layers=[0, 3, 6])
    cfg.extra["use_cache"] = True
    back = Eagle3Config.from_json(cfg.to_json())
    assert back == cfg
    assert back.feature_layers == [0, 3, 6]


def test_for_target_refuses_bad_layers_and_vocab():
    with pytest.raises(ConfigError, match="out of range"):
        Eagle3Config.for_target(TINY, draft_vocab_size=N_TINY, layers=[1, 3, 7])
    with pytest.raises(ConfigError, match="strictly increasing"):
        Eagle3Config.for_target(TINY, draft_vocab_size=N_TINY, layers=[3, 1, 5])
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        Eagle3Config.for_target(TINY, draft_vocab_size=TINY.vocab_size + 1)


def test_save_load_round_trip(tmp_path):
    head, cfg = _tiny_head()
    out = save_eagle3(head, cfg, tmp_path / "draft")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name != "draft"]  # temp dirs cleaned up
    from safetensors.torch import load_file

    raw = load_file(str(out / "model.safetensors"))
    assert set(raw) == set(head.state_dict())
    assert raw["d2t"].dtype == torch.int64 and raw["t2d"].dtype == torch.bool
    assert all(v.dtype == torch.bfloat16 for k, v in raw.items() if k not in ("d2t", "t2d"))

    loaded, lcfg = load_eagle3(out, target_args=TINY)
    assert lcfg == cfg
    for k, v in head.state_dict().items():
        w = loaded.state_dict()[k]
        if v.is_floating_point():
            assert torch.equal(w, v.to(torch.bfloat16).float()), k
        else:
            assert torch.equal(w, v) and w.dtype == v.dtype, k

    # saving again over the directory replaces it atomically
    save_eagle3(loaded, lcfg, out)
    again, _ = load_eagle3(out, target_args=TINY)
    for k, v in loaded.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def test_loads_checkpoint_written_as_specforge_does(tmp_path):
    cfg = Eagle3Config.for_target(TINY, draft_vocab_size=N_TINY)
    tensors = _spec_forge_tensors(cfg)
    tensors["embed_tokens.weight"] = torch.zeros(TINY.vocab_size, TINY.dim, dtype=torch.bfloat16)  # to_hf export
    conf = _spec_forge_config(cfg, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4]})
    _write_spec_forge(tmp_path / "sf", tensors, conf)
    head, lcfg = load_eagle3(tmp_path / "sf", target_args=TINY)
    assert lcfg.feature_layers == [1, 3, 4]
    assert lcfg.head_dim == TINY.head_dim
    sd = head.state_dict()
    assert "embed_tokens.weight" not in sd
    for k, v in tensors.items():
        if k != "embed_tokens.weight":
            assert torch.equal(sd[k], v.float() if v.is_floating_point() else v), k
    assert lcfg.extra["use_cache"] is True


def test_loads_sglang_name_variants_and_default_layers(tmp_path):
    cfg = Eagle3Config.for_target(TINY, draft_vocab_size=N_TINY)
    tensors = {("model." + k.replace("midlayer.", "layers.0.")): v for k, v in _spec_forge_tensors(cfg).items()}
    conf = _spec_forge_config(cfg)
    del conf["rope_theta"]
    conf["rope_parameters"] = {"rope_theta": 100000.0, "rope_type": "default"}
    _write_spec_forge(tmp_path / "sg", tensors, conf)
    head, lcfg = load_eagle3(tmp_path / "sg", target_args=TINY)
    assert lcfg.feature_layers == [1, 3, 4]  # [1, L//2 - 1, L - 4] for L = 8
    assert lcfg.rope_theta == 100000.0
    assert set(head.state_dict()) == set(_spec_forge_tensors(cfg))


@pytest.mark.parametrize("case, match", [
    ("hidden", "hidden_size 48 != target hidden size 32"),
    ("vocab", "vocab_size 120 != target vocab size 100"),
    ("arch", "architectures"),
    ("missing", r"missing tensors \['midlayer.hidden_norm.weight'\]"),
    ("extra", r"unexpected tensors \['midlayer.self_attn.q_proj.bias'\]"),
    ("shape", r"tensor midlayer.mlp.up_proj.weight: expected shape \[48, 32\], got \[47, 32\]"),
    ("t2d_count", "t2d marks 39 target ids"),
    ("d2t_order", "not strictly increasing"),
    ("d2t_range", "outside 0..99"),
    ("d2t_t2d", "not the ids t2d marks"),
    ("layers", "out of range"),
    ("tied", "tie_word_embeddings"),
    ("no_draft_vocab", "draft_vocab_size is unset"),
])
def test_mismatches_are_refused_by_name(tmp_path, case, match):
    cfg = Eagle3Config.for_target(TINY, draft_vocab_size=N_TINY)
    t = _spec_forge_tensors(cfg)
    conf = _spec_forge_config(cfg)
    if case == "hidden":
        conf["hidden_size"] = 48
    elif case == "vocab":
        conf["vocab_size"] = 120
    elif case == "arch":
        conf["architectures"] = ["LlamaForCausalLM"]
    elif case == "missing":
        del t["midlayer.hidden_norm.weight"]
    elif case == "extra":
        t["midlayer.self_attn.q_proj.bias"] = torch.zeros(32, dtype=torch.bfloat16)
    elif case == "shape":
        t["midlayer.mlp.up_proj.weight"] = t["midlayer.mlp.up_proj.weight"][:47]
    elif case == "t2d_count":
        t["t2d"][int(torch.nonzero(t["t2d"])[0])] = False
    elif case == "d2t_order":
        ids = torch.arange(N_TINY) + t["d2t"]
        ids[[0, 1]] = ids[[1, 0]]
        t["d2t"] = ids - torch.arange(N_TINY)
    elif case == "d2t_range":
        t["d2t"][-1] = 500
    elif case == "d2t_t2d":
        t2d = torch.zeros(TINY.vocab_size, dtype=torch.bool)
        t2d[TINY.vocab_size - N_TINY:] = True   # right count, other ids than d2t's
        if torch.equal(t2d, t["t2d"]):
            t2d = torch.zeros_like(t2d)
            t2d[:N_TINY] = True
        t["t2d"] = t2d
    elif case == "layers":
        conf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 7]}
    elif case == "tied":
        conf["tie_word_embeddings"] = True
    elif case == "no_draft_vocab":
        del conf["draft_vocab_size"]
    _write_spec_forge(tmp_path / "bad", t, conf)
    with pytest.raises(ModelLoadError, match=match):
        load_eagle3(tmp_path / "bad", target_args=TINY)


def test_missing_files_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_eagle3(tmp_path, target_args=TINY)


# ---------------------------------------------------------------------------------------------

def _check_map(d2t, t2d, N, V):
    assert d2t.dtype == torch.int64 and d2t.shape == (N,)
    assert t2d.dtype == torch.bool and t2d.shape == (V,)
    ids = torch.arange(N) + d2t
    assert int(t2d.sum()) == N
    assert bool((ids[1:] > ids[:-1]).all())
    assert bool(t2d[ids].all())
    assert bool((d2t >= 0).all()) and bool((d2t[1:] >= d2t[:-1]).all())
    return ids


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=60), st.data())
def test_build_vocab_map_properties(counts, data):
    V = len(counts)
    N = data.draw(st.integers(1, V))
    d2t, t2d = build_vocab_map(counts, N)
    ids = _check_map(d2t, t2d, N, V)
    chosen = set(ids.tolist())
    # every chosen id is at least as frequent as every id left out
    left = [counts[i] for i in range(V) if i not in chosen]
    if left:
        assert min(counts[i] for i in chosen) >= max(left)


def test_build_vocab_map_mapping_and_padding():
    d2t, t2d = build_vocab_map({7: 5, 3: 9, 90: 1}, 5, vocab_size=100)
    ids = _check_map(d2t, t2d, 5, 100)
    assert ids.tolist() == [0, 1, 3, 7, 90]   # seen ids, padded with 0, 1, ... at count 0
    with pytest.raises(ConfigError):
        build_vocab_map({1: 1}, 5)
    with pytest.raises(ConfigError):
        build_vocab_map([1, 2], 3)


# ---------------------------------------------------------------------------------------------

def test_forward_shapes_and_target_ids():
    head, cfg = _tiny_head()
    T, H = 6, TINY.dim
    torch.manual_seed(3)
    feats = [torch.randn(T, H) for _ in range(3)]
    g = head.fuse(*feats)
    assert g.shape == (T, H)
    embeds = torch.randn(T, H)
    with torch.no_grad():
        logits, h2 = head(embeds, g, torch.arange(T))
        logits3, h2b = head(embeds, torch.cat(feats, dim=-1), torch.arange(T))  # fc applied for 3H input
    assert logits.shape == (T, N_TINY) and h2.shape == (T, H)
    torch.testing.assert_close(logits3, logits)
    tid = head.to_target_ids(logits.argmax(-1))
    assert bool(((tid >= 0) & (tid < TINY.vocab_size)).all())
    assert bool(head.t2d[tid].all())


def test_causal_and_kv_cache_consistency():
    head, _ = _tiny_head(seed=5)
    T, H = 7, TINY.dim
    torch.manual_seed(4)
    embeds, hidden = torch.randn(T, H), torch.randn(T, H)
    pos = torch.arange(T)
    with torch.no_grad():
        full, h_full = head(embeds, hidden, pos)
        e2, s2 = embeds.clone(), hidden.clone()
        e2[5:] += 1.0
        s2[5:] -= 1.0
        changed, _ = head(e2, s2, pos)
        torch.testing.assert_close(changed[:5], full[:5], rtol=0, atol=0)
        assert not torch.allclose(changed[5:], full[5:])
        # prefix through a KV cache, then the rest one row at a time: same logits
        kv = Eagle3KV()
        a, _ = head(embeds[:4], hidden[:4], pos[:4], kv=kv)
        rows = [a]
        for t in range(4, T):
            r, _ = head(embeds[t:t + 1], hidden[t:t + 1], pos[t:t + 1], kv=kv)
            rows.append(r)
        assert len(kv) == T
        torch.testing.assert_close(torch.cat(rows), full, rtol=1e-5, atol=1e-5)
        # a draft step on the previous output: mask sees the cache, h2 feeds the next step
        kv.truncate(5)
        step, h_next = head(embeds[5:6], h_full[4:5], torch.tensor([5]), kv=kv,
                            mask=torch.ones(1, 6, dtype=torch.bool))
        assert step.shape == (1, N_TINY) and h_next.shape == (1, H) and len(kv) == 6


def test_rope_is_relative():
    head, _ = _tiny_head(seed=2)
    torch.manual_seed(0)
    e, s = torch.randn(3, TINY.dim), torch.randn(3, TINY.dim)
    with torch.no_grad():
        a, _ = head(e, s, torch.arange(3))
        b, _ = head(e, s, torch.arange(3) + 10)       # same relative offsets
        c, _ = head(e, s, torch.tensor([0, 5, 9]))    # other offsets
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(a[0], c[0])
    assert not torch.allclose(a[1:], c[1:], rtol=1e-4, atol=1e-4)


def test_eagle3_not_imported_by_drafting_package():
    import subprocess
    import sys

    code = "import agentspec.drafting, sys; print('agentspec.drafting.eagle3' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
