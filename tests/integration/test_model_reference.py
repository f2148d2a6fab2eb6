"""Our model against Hugging Face transformers' GGUF loading of the same file; the safetensors path."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import agentspec
from agentspec.backends.embedded.model import KVCache, Transformer
from agentspec.backends.embedded.weights import bundled_model_path, load_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.extended]   # extended tier: logits against transformers


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """The bundled GGUF as a Hugging Face folder (config + float32 safetensors + tokenizer.json),
    written by transformers' own GGUF loading through the shipped converter
    (``python -m agentspec.integrations.sglang.convert``): once for the module, the reference
    model and the safetensors-loading test both read it."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    folder = tmp_path_factory.mktemp("hf") / "smollm2-hf"
    r = subprocess.run([sys.executable, "-P", "-m", "agentspec.integrations.sglang.convert", str(folder),
                        "--dtype", "float32"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return folder


@pytest.fixture(scope="module")
def hf_model(hf_folder):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_folder), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def ours_fp32():
    ckpt = load_checkpoint(quiet=True)
    m = Transformer(ckpt.args, init_weights=False)
    ckpt.load_into(m)
    return m.eval(), ckpt


def test_logits_match_transformers(hf_model, ours_fp32, rewrite_prompts, chat_prompts):
    model, ckpt = ours_fp32
    for ids in [rewrite_prompts[0][:400], chat_prompts[0], chat_prompts[3]]:
        cache = KVCache(ckpt.args, 512, dtype=torch.float32, device="cpu")
        ours = model(torch.tensor(ids), torch.arange(len(ids)), cache)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-3)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_decode_step_logits_match_transformers(hf_model, ours_fp32, chat_prompts):
    """Prefill then one token at a time through the cache, against a full forward."""
    model, ckpt = ours_fp32
    ids = chat_prompts[1] + [28, 253, 2132]
    cache = KVCache(ckpt.args, 512, dtype=torch.float32, device="cpu")
    model(torch.tensor(ids[:-3]), torch.arange(len(ids) - 3), cache)
    cache.commit(list(range(len(ids) - 3)))
    rows = []
    for p in range(len(ids) - 3, len(ids)):
        rows.append(model(torch.tensor([ids[p]]), torch.tensor([p]), cache)[0])
        cache.commit([0])
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0, -3:].float()
    torch.testing.assert_close(torch.stack(rows), ref, atol=2e-3, rtol=1e-3)


def test_safetensors_folder_loads_through_the_same_path(hf_folder, chat_prompts):
    """A Hugging Face folder (config + safetensors + tokenizer.json, written by transformers'
    own GGUF conversion) gives the same model as the GGUF file."""
    folder = hf_folder
    # row_cost given: a fresh folder is a new model to the row-cost profile cache (a measurement
    # of seconds and a cache entry per run) and plain decoding below does not use it
    eng = agentspec.Engine.embedded(model=str(folder), dtype="float32", quiet=True, row_cost=0.05)
    ref = agentspec.Engine.embedded(dtype="float32", quiet=True)
    assert eng.args == ref.args
    for name, tensor in ref.model.state_dict().items():
        torch.testing.assert_close(eng.model.state_dict()[name], tensor, atol=1e-6, rtol=0, msg=name)
    ids = chat_prompts[0]
    assert eng.generate(ids, max_tokens=12, spec=None).token_ids == ref.generate(ids, max_tokens=12, spec=None).token_ids


def test_tokenizer_matches_transformers_gguf_tokenizer(engine):
    transformers = pytest.importorskip("transformers")
    path = bundled_model_path()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # transformers' GGUF converter skips SmolLM's digit splitting (llama.cpp's "smollm" pre-tokenizer
    # splits digits one by one, as SmolLM2's own tokenizer.json does), so compare text without digits
    texts = [
        "def add(a, b):\n    return a + b\n",
        "Hello, world! Ça va? 日本語のテキスト.\n\n\tIndented    spaces",
        "<|im_start|>user\nhi<|im_end|>\n",
    ]
    for t in texts:
        assert engine.tokenizer.encode(t) == hf_tok.encode(t, add_special_tokens=False), t
        assert engine.tokenizer.decode(engine.tokenizer.encode(t)) == t
    assert engine.tokenizer.encode("2024") == [engine.tokenizer.backend.token_to_id(c) for c in "2024"]
