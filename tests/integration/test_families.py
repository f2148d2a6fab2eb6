"""Every model family the embedded engine serves, against transformers on the same weights.

For each family (Llama 3.1 with llama3 rope scaling and tied embeddings, Mistral with a sliding
window, Qwen2 with q/k/v biases, Qwen3 with q/k norms, an explicit head_dim and a GQA ratio the
native kernels do not take) transformers writes a small random-weight checkpoint with the
bundled tokenizer (tests/helpers/families.py); the gguf package writes the same
weights as GGUF. Checked: logits and greedy tokens equal transformers' (float32); speculation on
equals off (bfloat16 on the native kernels and float32), verification rows bit for bit at every
ISA level; GGUF (F32, Q8_0, K-quants) loads the same tensors as the folder; chat templates render
as ``apply_chat_template`` does; end-of-turn ids stop; bad checkpoints are refused by name.
"""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch

import agentspec
from agentspec import SpecConfig
from agentspec.drafting import Draft
from agentspec.backends.embedded.model import KVCache, Transformer
from agentspec.backends.embedded.weights import load_checkpoint
from agentspec.errors import ConfigError, ModelLoadError

from helpers.families import write_family, write_gguf, write_quantized_pair
from helpers.trees import with_decoys

pytestmark = [pytest.mark.slow, pytest.mark.extended]   # extended tier: every family against transformers
transformers = pytest.importorskip("transformers")

# family -> write_family options: head_dim 64 (the native kernels' shape) for three families;
# Qwen3 with head_dim 32 and 12 query heads per kv head takes the torch fallback
SHAPES = {
    "llama": dict(dim=256, heads=4, kv_heads=2, hidden=512),
    "mistral": dict(dim=256, heads=4, kv_heads=1, hidden=512),
    "qwen2": dict(dim=256, heads=2, kv_heads=1, hidden=512),     # head_dim 128, as Qwen2.5-Coder 1.5B/7B
    "qwen3": dict(dim=128, heads=12, kv_heads=1, hidden=256),
}
CONVERSATION = [
    {"role": "system", "content": "You rewrite Python files. Answer with the whole file."},
    {"role": "user", "content": "Rename add to plus:\n```python\ndef add(a, b):\n    return a + b\n\n\n"
                                "def twice(x):\n    return add(x, x)\n```"},
    {"role": "assistant", "content": "```python\ndef plus(a, b):\n    return a + b\n```"},
    {"role": "user", "content": "Now the whole file, please."},
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: write_family(root / f, f, **SHAPES[f]) for f in SHAPES}


@pytest.fixture(scope="module")
def engines(folders):
    """(float32, bfloat16) engines per family; row_cost given (no start-up profile per model)."""
    out = {}
    for f, d in folders.items():
        out[f] = tuple(agentspec.Engine.embedded(model=str(d), dtype=dt, quiet=True, row_cost=0.05, prefix_cache_bytes=0)
                       for dt in ("float32", "bfloat16"))
    return out


def _prompt(engine):
    return engine.encode(CONVERSATION)


@pytest.mark.parametrize("family", list(SHAPES))
def test_logits_and_greedy_equal_transformers(family, folders, engines):
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folders[family]), dtype=torch.float32).eval()
    eng = engines[family][0]
    ids = _prompt(eng)
    assert len(ids) > 64   # past Llama's original_max_position_embeddings (64): the llama3 scaling acts
    cache = KVCache(eng.args, 512, dtype=torch.float32, device="cpu")
    ours = eng.model(torch.tensor(ids), torch.arange(len(ids)), cache)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    want = ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                        eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    got = eng.generate(ids, max_tokens=24, spec=None, stop=None)
    assert got.token_ids == want[:len(got.token_ids)]
    assert len(got.token_ids) == 24 or got.token_ids[-1] in eng.tokenizer.eos_token_ids


class OracleTreeDrafter:
    """Drafts the known answer with decoy siblings (so verification walks real trees, accepts
    long paths and compacts the KV cache), then random twigs."""

    def __init__(self, answer: list[int], vocab: int, seed: int = 0):
        self.answer, self.vocab, self.rng = answer, vocab, random.Random(seed)
        self.pos = 0

    def start(self, req_id, prompt, *, tenant="default"):
        self.pos = 0

    def extend(self, req_id, tokens):
        self.pos += len(tokens)

    def stop(self, req_id):
        pass

    def propose(self, req_id, budget):
        chain = self.answer[self.pos:self.pos + max(budget // 2, 1)]
        tokens, parents = with_decoys(chain, budget, self.rng, self.vocab)
        if self.rng.random() < 0.3:   # now and then a wrong turn mid-way
            tokens, parents = tokens[:len(tokens) // 2], parents[:len(tokens) // 2]
        return Draft(tokens, parents, [0.9] * len(tokens), source="oracle-tree")


@pytest.mark.parametrize("family", list(SHAPES))
@pytest.mark.parametrize("dtype_index", [0, 1], ids=["float32", "bfloat16"])
def test_speculation_equals_plain(family, dtype_index, engines):
    eng = engines[family][dtype_index]
    ids = _prompt(eng)
    plain = eng.generate(ids, max_tokens=48, spec=None, stop=None)
    spec = eng.generate(ids, max_tokens=48, stop=None,
                        drafter=OracleTreeDrafter(plain.token_ids, eng.vocab_size), spec=SpecConfig(row_cost=0.0))
    assert spec.token_ids == plain.token_ids
    assert spec.stats.accepted_tokens > 10 and spec.stats.steps < len(plain.token_ids) / 2
    # and the engine's own drafters (suffix index over the prompt and the output)
    assert eng.generate(ids, max_tokens=48, stop=None).token_ids == plain.token_ids


def _isa_levels():
    from agentspec.kernels import cpu_isa

    return [isa for isa in cpu_isa.supported() if isa != "scalar"] or ["scalar"]


@pytest.mark.parametrize("isa_level", _isa_levels())
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_verification_rows_equal_plain_rows_bitwise(family, isa_level, engines, restore_isa):
    """Every accepted-path row of every verification forward has the very logits plain decoding
    computes for that position (bfloat16, the native kernels where the shape takes them)."""
    cpu_isa = restore_isa
    if cpu_isa.ISA_LEVELS.index(isa_level) > cpu_isa.ISA_LEVELS.index(cpu_isa.active()):
        pytest.skip(f"kernels capped at {cpu_isa.active()}")
    cpu_isa.set_isa(isa_level)
    _verified_rows_equal_plain_rows(engines[family][1])


def _verified_rows_equal_plain_rows(eng) -> None:
    """Greedy speculation (oracle trees with decoys) equals plain decoding, and every accepted-path
    row of every verification forward has the very logits plain decoding computed there."""
    ids = _prompt(eng)
    P = len(ids)
    recorded = []
    forward = eng.model.forward

    def spy(tok, pos, cache, mask=None, **kw):
        out = forward(tok, pos, cache, mask, **kw)
        recorded.append((tok.clone(), pos.clone(), None if mask is None else mask.clone(), out.clone(), cache.length))
        return out

    eng.model.forward = spy
    try:
        plain = eng.generate(ids, max_tokens=40, spec=None, stop=None)
        plain_logits = {P + j - 1: recorded[j][3][0] for j in range(1, len(recorded))}
        recorded.clear()
        g = eng.generate(ids, max_tokens=40, stop=None, spec=SpecConfig(row_cost=0.0),
                         drafter=OracleTreeDrafter(plain.token_ids, eng.vocab_size, seed=3))
    finally:
        del eng.model.forward
    out = g.token_ids
    assert out == plain.token_ids
    checked = mismatched = 0
    for tok, pos, mask, logits, start in recorded[1:]:
        T = tok.shape[0]
        for r in range(T):
            p = pos[r].item()
            j = p - P
            if not 0 <= j < len(out) or tok[r].item() != out[j] or p not in plain_logits:
                continue
            seen = mask[r, start:start + T].nonzero().flatten().tolist() if mask is not None else [r]
            if all(tok[a].item() == out[pos[a].item() - P] for a in seen):
                checked += 1
                mismatched += not torch.equal(logits[r], plain_logits[p])
    assert checked > 30
    assert mismatched == 0, f"{mismatched} of {checked} verification rows differ from plain decoding"


# -- rope scaling ------------------------------------------------------------------------------

@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
     "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
], ids=["linear", "yarn", "yarn-mscale", "dynamic"])
def test_rope_scaling_equals_transformers(rope, tmp_path):
    folder = write_family(tmp_path / "m", "llama", dim=128, heads=2, kv_heads=1, hidden=256, layers=1,
                          rope_parameters=rope, max_position_embeddings=128)
    ckpt = load_checkpoint(folder, quiet=True)
    if rope["rope_type"] == "dynamic":
        assert ckpt.args.max_seq_len == 128 and ckpt.args.rope_scaling == ()
    model = Transformer(ckpt.args, init_weights=False)
    ckpt.load_into(model)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = list(range(1000, 1120))
    ours = model(torch.tensor(ids), torch.arange(len(ids)), KVCache(ckpt.args, 256, dtype=torch.float32, device="cpu"))
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


# -- formats ------------------------------------------------------------------------------------

def _tensors(path) -> dict[str, torch.Tensor]:
    return load_checkpoint(path, quiet=True).state_dict()


@pytest.mark.parametrize("family", list(SHAPES))
def test_gguf_f32_holds_the_folder_tensors(family, folders, tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTSPEC_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = write_gguf(folders[family], tmp_path / f"{family}.gguf", qtype="F32")
    a, b = load_checkpoint(gguf_path, quiet=True), load_checkpoint(folders[family], quiet=True)
    # the same architecture; GGUF stores the norm epsilon as float32 and Llama 3.1's rope scaling
    # as per-frequency divisors (rope_freqs), which give the same rotary tables
    same = ("dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "vocab_size", "rope_base", "tie_embeddings",
            "head_dim", "qkv_bias", "qk_norm", "max_seq_len")
    assert a.args.family == ("llama" if family == "mistral" else family)   # llama.cpp writes Mistral as 'llama'
    assert {k: getattr(a.args, k) for k in same} == {k: getattr(b.args, k) for k in same}
    assert a.args.norm_eps == pytest.approx(b.args.norm_eps, rel=1e-6)
    from agentspec.backends.embedded.model import rope_tables
    for x, y in zip(rope_tables(a.args), rope_tables(b.args)):   # rope_freqs are float32: close, not equal
        torch.testing.assert_close(x[:512], y[:512], atol=1e-4, rtol=0)
    ta, tb = a.state_dict(), b.state_dict()
    assert ta.keys() == tb.keys()
    for name in tb:
        assert torch.equal(ta[name], tb[name]), name
    # the tokenizer and template from GGUF metadata: same ids, same rendering, same stops
    assert a.tokenizer.encode("def f(x):\n    return x  # 123") == b.tokenizer.encode("def f(x):\n    return x  # 123")
    assert a.tokenizer.apply_chat_template(CONVERSATION[:2]) == b.tokenizer.apply_chat_template(CONVERSATION[:2])
    # every stop of the folder (llama.cpp's metadata also names <|endoftext|>, which stops too)
    assert b.tokenizer.eos_token_ids <= a.tokenizer.eos_token_ids


def test_gguf_q8_0_logits_follow_the_dequantized_weights(folders, tmp_path, monkeypatch):
    """A Q8_0 GGUF: the engine's weights are the gguf package's dequantization, and its greedy
    decoding (speculation on) equals plain."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    monkeypatch.setenv("AGENTSPEC_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(folders["qwen2"], tmp_path / "q8.gguf", qtype="Q8_0")
    ours = _tensors(path)
    raw = {t.name: t for t in GGUFReader(str(path)).tensors}
    down = dequantize(raw["blk.1.ffn_down.weight"].data, raw["blk.1.ffn_down.weight"].tensor_type)
    assert torch.equal(ours["layers.1.w_down.weight"], torch.from_numpy(np.asarray(down, np.float32)).view(256, 512))
    eng = agentspec.Engine.embedded(model=str(path), quiet=True, row_cost=0.05, prefix_cache_bytes=0)
    assert eng.args.qkv_bias
    ids = _prompt(eng)
    assert eng.generate(ids, max_tokens=32, stop=None).token_ids == eng.generate(ids, max_tokens=32, spec=None,
                                                                              stop=None).token_ids


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_k_quants_equal_the_reference_block_by_block(family, tmp_path, monkeypatch):
    """Q4_K / Q5_K / Q6_K tensors (random blocks; Llama's Q/K rows permuted as llama.cpp writes
    them) load as the gguf package's reference dequantization, tensor by tensor; the folder
    holding those dequantized weights gives transformers' logits."""
    import gguf
    from gguf import GGUFReader
    from gguf.quants import dequantize

    monkeypatch.setenv("AGENTSPEC_CACHE_DIR", str(tmp_path / "cache"))
    folder = write_family(tmp_path / family, family, **SHAPES[family], layers=1)
    path = write_quantized_pair(folder, tmp_path / f"{family}-kq.gguf",
                                {"ffn_down.weight": "Q6_K", "attn_v.weight": "Q5_K", "token_embd.weight": "Q6_K"})
    reader = GGUFReader(str(path))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert {types["blk.0.ffn_down.weight"], types["blk.0.attn_v.weight"], types["blk.0.attn_q.weight"]} == {
        gguf.GGMLQuantizationType.Q6_K, gguf.GGMLQuantizationType.Q5_K, gguf.GGMLQuantizationType.Q4_K}
    ours, folder_tensors = _tensors(path), _tensors(folder)
    for name in folder_tensors:
        assert torch.equal(ours[name], folder_tensors[name]), name
    # block by block: a Q4_K row of 256 values is one super-block
    by_name = {t.name: t for t in reader.tensors}
    t = by_name["blk.0.ffn_gate.weight"]
    ref = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(512, 256)
    assert torch.equal(ours["layers.0.w_gate_up.weight"][:512], torch.from_numpy(ref))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    eng = agentspec.Engine.embedded(model=str(path), dtype="float32", quiet=True, row_cost=0.05, prefix_cache_bytes=0)
    ids = _prompt(eng)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    ours_logits = eng.model(torch.tensor(ids), torch.arange(len(ids)), KVCache(eng.args, 512, dtype=torch.float32,
                                                                               device="cpu"))
    torch.testing.assert_close(ours_logits, theirs, atol=1e-4, rtol=1e-4)


def test_sharded_folder_loads_tensor_by_tensor(tmp_path, folders):
    sharded = write_family(tmp_path / "sharded", "qwen2", **SHAPES["qwen2"], shards=True)
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 3
    a, b = _tensors(sharded), _tensors(folders["qwen2"])
    assert all(torch.equal(a[k], b[k]) for k in b)


# -- tokenizer, template, stops -----------------------------------------------------------------

@pytest.mark.parametrize("family", list(SHAPES))
def test_chat_template_renders_as_transformers(family, folders, engines):
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(folders[family]))
    ours = engines[family][0].tokenizer
    for conv in (CONVERSATION, CONVERSATION[:2], CONVERSATION[1:2]):
        for gen in (True, False):
            assert ours.apply_chat_template(conv, add_generation_prompt=gen) == hf_tok.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=gen), (conv, gen)


def test_template_errors_are_clear(engines):
    with pytest.raises(ValueError, match="roles must alternate"):
        engines["mistral"][0].tokenizer.apply_chat_template([{"role": "assistant", "content": "hi"}])


def test_end_of_turn_ids_stop(engines, folders):
    llama = engines["llama"][0].tokenizer
    eot = llama.backend.token_to_id("<|eot_id|>")
    assert eot in llama.eos_token_ids and llama.eos_token_id == eot
    qwen = engines["qwen2"][0].tokenizer
    assert qwen.backend.token_to_id("<|im_end|>") in qwen.eos_token_ids
    # a generation stops at the first end-of-turn id the model emits
    eng = engines["qwen3"][0]
    ids = _prompt(eng)
    free = eng.generate(ids, max_tokens=24, spec=None, stop=None).token_ids
    eng.tokenizer.eos_token_ids = frozenset({*eng.tokenizer.eos_token_ids, free[5]})
    try:
        assert eng.generate(ids, max_tokens=24, spec=None, stop=None).token_ids == free[:free.index(free[5])]
    finally:
        eng.tokenizer.eos_token_ids = frozenset(eng.tokenizer.eos_token_ids - {free[5]})


# -- refusals -----------------------------------------------------------------------------------

def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("change, message", [
    (dict(model_type="gemma3"), r"model_type 'gemma3' is not supported; supported: llama, mistral, qwen2, qwen3"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e6, "factor": 4.0}), r"rope type 'longrope'"),
    (dict(attn_logit_softcapping=50.0), r"attn_logit_softcapping"),
    (dict(partial_rotary_factor=0.5), r"partial_rotary_factor"),
    (dict(attention_bias=True), r"attention_bias"),
    (dict(num_local_experts=8), r"num_local_experts"),
    (dict(hidden_act="gelu"), r"hidden_act 'gelu'"),
    (dict(intermediate_size=384), r"tensor 'layers.0.w_gate_up.weight' has shape \(1024, 256\), the config says \(768, 256\)"),
])
def test_bad_checkpoints_are_refused_by_name(change, message, folders, tmp_path):
    bad = _edit_config(folders["qwen2"], tmp_path / "bad", **change)
    with pytest.raises(ModelLoadError, match=message):
        agentspec.Engine.embedded(model=str(bad), quiet=True, row_cost=0.05, prefix_cache_bytes=0)


def test_missing_tensor_is_refused_by_name(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(folders["llama"], bad)
    state = load_file(str(bad / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        agentspec.Engine.embedded(model=str(bad), quiet=True, row_cost=0.05)


def test_gguf_unknown_arch_is_refused(tmp_path):
    import gguf

    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"GGUF architecture 'phi3' is not supported; supported: llama, qwen2, qwen3"):
        load_checkpoint(path, quiet=True)


# -- the server ---------------------------------------------------------------------------------

def test_serve_model_folder_answers_with_transformers_tokens(folders, tmp_path):
    """``agentspec serve`` with ``model = DIR`` in its config (as ``--model DIR``; speculation on)
    through the openai client: the served
    model id is the folder's name, the chat uses the checkpoint's template, and the greedy
    tokens are transformers' on the same weights."""
    from helpers.serve import Server

    folder = folders["qwen2"]
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = hf_tok.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    want = ref.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, pad_token_id=0,
                        eos_token_id=hf_tok.convert_tokens_to_ids("<|im_end|>"))[0, len(ids):].tolist()
    want_text = hf_tok.decode([t for t in want if t != hf_tok.convert_tokens_to_ids("<|im_end|>")])
    server = Server(tmp_path, config=f'[server]\nmodel = "{folder}"\n', args=["--dtype", "float32"],
                    env={"AGENTSPEC_CACHE_DIR": str(tmp_path / "cache")})
    try:
        client = server.client()
        assert [m.id for m in client.models.list().data] == [folder.name]
        r = client.chat.completions.create(model=folder.name, messages=CONVERSATION, max_tokens=20, temperature=0)
        assert r.choices[0].message.content == want_text
        assert r.usage.prompt_tokens == len(ids)
    finally:
        server.stop()


# -- quantized weights kept quantized -----------------------------------------------------------

@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """family -> (GGUF engine with its K-quant projections kept quantized, the folder of their
    dequantization): Llama (head_dim 64, fused rows, Q/K rows permuted in the file) and Qwen2
    (head_dim 128, layered rows, q/k/v biases)."""
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for family in ("llama", "qwen2"):
        folder = write_family(root / family, family, **SHAPES[family])
        path = write_quantized_pair(folder, root / f"{family}.gguf", {"ffn_down.weight": "Q6_K",
                                                                      "attn_v.weight": "Q5_K", "token_embd.weight": "Q6_K"})
        eng = agentspec.Engine.embedded(model=str(path), quiet=True, row_cost=0.05, prefix_cache_bytes=0,
                                        weights="quantized")
        out[family] = (eng, folder)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_quantized_weights_give_the_dequantized_models_logits(family, quantized):
    eng, folder = quantized[family]
    info = eng.kernel_info()
    assert info["weights"]["quantized"] and set(info["weights"]["types"]) == {"Q4_K", "Q5_K", "Q6_K"}
    assert info["kernel_plan"]["rows_linears"] == "quantized" == info["kernel_plan"]["prefill_linears"]
    assert eng.model.layers[0].wqkv.weight.numel() == 0   # no dense copy of a projection
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    dense = agentspec.Engine.embedded(model=str(folder), quiet=True, row_cost=0.05, prefix_cache_bytes=0)
    ids = _prompt(eng)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].double()
    ours, bf16 = (e.model(torch.tensor(ids), torch.arange(len(ids)), e.new_cache(512)).double() for e in (eng, dense))

    def err(x):   # the median row's relative error (random weights give sharp attention, where a
        # small change can move a row's attention to another key: such a row is far off either way)
        return ((x - theirs).norm(dim=-1) / theirs.norm(dim=-1)).median().item()
    # against the float32 model: the dense bfloat16 engine's error (bfloat16 hidden states) and, on
    # top, the int8 activations' (~0.5% per projection): within twice the former plus 2%
    assert err(ours) < 2 * err(bf16) + 0.02, (err(ours), err(bf16))
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item() > 0.9


@pytest.mark.parametrize("isa_level", _isa_levels())
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_quantized_verification_rows_equal_plain_rows_bitwise(family, isa_level, quantized, restore_isa):
    cpu_isa = restore_isa
    if cpu_isa.ISA_LEVELS.index(isa_level) > cpu_isa.ISA_LEVELS.index(cpu_isa.active()):
        pytest.skip(f"kernels capped at {cpu_isa.active()}")
    cpu_isa.set_isa(isa_level)
    _verified_rows_equal_plain_rows(quantized[family][0])


@pytest.fixture(scope="module")
def bf16_kv(folders, quantized):
    """family -> engine with a bfloat16 KV cache: dense bfloat16 Llama (head_dim 64) and Qwen2
    (head_dim 128), and the quantized Qwen2 file."""
    kw = dict(quiet=True, row_cost=0.05, prefix_cache_bytes=0, kv_dtype="bfloat16")
    out = {f: agentspec.Engine.embedded(model=str(folders[f]), dtype="bfloat16", **kw) for f in ("llama", "qwen2")}
    out["qwen2-quantized"] = agentspec.Engine.embedded(model=str(quantized["qwen2"][0].model_path), weights="quantized",
                                                       **kw)
    return out


@pytest.mark.parametrize("isa_level", _isa_levels())
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen2-quantized"])
def test_bfloat16_kv_verification_rows_equal_plain_rows_bitwise(family, isa_level, bf16_kv, restore_isa):
    """A bfloat16 KV cache read by the native attention: speculation equals plain decoding and
    every verified row has plain decoding's bits."""
    cpu_isa = restore_isa
    if cpu_isa.ISA_LEVELS.index(isa_level) > cpu_isa.ISA_LEVELS.index(cpu_isa.active()):
        pytest.skip(f"kernels capped at {cpu_isa.active()}")
    cpu_isa.set_isa(isa_level)
    eng = bf16_kv[family]
    plan = eng.kernel_info()["kernel_plan"]
    # the float32 kernel below avx512bf16, its bfloat16-product mode at it
    assert eng.kernel_info()["kv_dtype"] == "bfloat16"
    assert plan["rows_attention"] == ("dot" if isa_level == "avx512bf16" else "native")
    assert eng.new_cache(64).k.dtype == torch.bfloat16
    if family == "qwen2-quantized":   # decodes one row a step: no padding row
        assert eng.model.row_invariant(eng.new_cache(64))
    _verified_rows_equal_plain_rows(eng)


@pytest.mark.parametrize("isa_level", _isa_levels())
def test_the_default_kv_cache_is_bfloat16_where_it_gives_float32s_bits(isa_level, folders, quantized, restore_isa):
    """Without kv_dtype a bfloat16 model on the layered rows path (head_dim 128: Qwen2, dense or
    quantized) gets a bfloat16 cache, and every logit of a greedy decode equals the float32
    cache's; the fused head_dim-64 path and float32 models keep float32."""
    cpu_isa = restore_isa
    if cpu_isa.ISA_LEVELS.index(isa_level) > cpu_isa.ISA_LEVELS.index(cpu_isa.active()):
        pytest.skip(f"kernels capped at {cpu_isa.active()}")
    cpu_isa.set_isa(isa_level)
    eng = quantized["qwen2"][0]
    assert eng.kv_dtype == torch.bfloat16 and eng.new_cache(64).k.dtype == torch.bfloat16
    assert quantized["llama"][0].kv_dtype == torch.float32
    f32 = agentspec.Engine.embedded(model=str(eng.model_path), weights="quantized", kv_dtype="float32", quiet=True,
                                    row_cost=0.05, prefix_cache_bytes=0)
    ids = _prompt(eng)
    want = f32.generate(ids, max_tokens=32, spec=None, stop=None)
    got = eng.generate(ids, max_tokens=32, spec=None, stop=None)
    assert got.token_ids == want.token_ids
    # the logits of the last position, bit for bit
    seq = torch.tensor(ids + got.token_ids[:-1])
    outs = []
    for e in (eng, f32):
        cache = e.new_cache(len(seq) + 8)
        outs.append(e.model(seq, torch.arange(len(seq)), cache, logits_rows=slice(-1, None), prefill=True))
    assert torch.equal(outs[0], outs[1])
    dense = agentspec.Engine.embedded(model=str(folders["qwen2"]), dtype="bfloat16", quiet=True, row_cost=0.05,
                                      prefix_cache_bytes=0)
    assert dense.kv_dtype == torch.bfloat16
    assert agentspec.Engine.embedded(model=str(folders["qwen2"]), dtype="float32", quiet=True, row_cost=0.05,
                                     prefix_cache_bytes=0).kv_dtype == torch.float32


def test_quantized_weights_are_refused_where_they_cannot_run(tmp_path, folders):
    with pytest.raises(ConfigError, match="weights='quantized' cannot run here: the model is not a GGUF file"):
        agentspec.Engine.embedded(model=str(folders["qwen2"]), quiet=True, row_cost=0.05, weights="quantized")
    with pytest.raises(ConfigError, match="weights='fast': use auto, quantized or dense"):
        agentspec.Engine.embedded(model=str(folders["qwen2"]), quiet=True, row_cost=0.05, weights="fast")
