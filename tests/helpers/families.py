"""Small random-weight checkpoints of every family the engine serves, written by transformers
itself (``from_config(...).save_pretrained``) with the bundled model's tokenizer, and the same
weights as GGUF files written with the ``gguf`` package (llama.cpp's tensor names and layouts).

Used by tests/integration/test_families.py. No downloads: everything is made here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import tqdm

# no tqdm monitor thread (transformers' and gguf's progress bars): the suite fails leaked threads
tqdm.tqdm.monitor_interval = 0

# a ChatML template with a default system prompt and a tools branch (Qwen2.5's shape)
QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}{%- if (message.role == 'user') or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama 3.1's shape: header tokens, <|eot_id|>, a date from strftime_now, a namespace, bos_token
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- if not date_string is defined %}{%- set date_string = strftime_now('%d %b %Y') %}"
    "{%- endif %}{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{%- set ns = namespace(turns=0) %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{{- 'Cutting Knowledge Date: December 2023\\n' }}"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}{%- set ns.turns = ns.turns + 1 %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# Mistral's shape: alternation enforced with raise_exception, [INST] markers, eos after answers
MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}{%- if message['role'] == 'user' %}{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}{%- else %}"
    "{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}{%- elif message['role'] == 'assistant' %}"
    "{{- ' ' + message['content'] + eos_token }}{%- endif %}{%- endfor %}"
)

LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Qwen2.5-Coder-Instruct's own chat template, as its GGUF files carry it (Apache-2.0, Qwen): tools in
# the system turn, calls as <tool_call>{json}</tool_call>, results as <tool_response> in a user turn
QWEN25_TOOLS_TEMPLATE = '{%- if tools %}\n    {{- \'<|im_start|>system\\n\' }}\n    {%- if messages[0][\'role\'] == \'system\' %}\n        {{- messages[0][\'content\'] }}\n    {%- else %}\n        {{- \'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.\' }}\n    {%- endif %}\n    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n    {%- for tool in tools %}\n        {{- "\\n" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n{%- else %}\n    {%- if messages[0][\'role\'] == \'system\' %}\n        {{- \'<|im_start|>system\\n\' + messages[0][\'content\'] + \'<|im_end|>\\n\' }}\n    {%- else %}\n        {{- \'<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n\' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}\n        {{- \'<|im_start|>\' + message.role + \'\\n\' + message.content + \'<|im_end|>\' + \'\\n\' }}\n    {%- elif message.role == "assistant" %}\n        {{- \'<|im_start|>\' + message.role }}\n        {%- if message.content %}\n            {{- \'\\n\' + message.content }}\n        {%- endif %}\n        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n            {{- \'\\n<tool_call>\\n{"name": "\' }}\n            {{- tool_call.name }}\n            {{- \'", "arguments": \' }}\n            {{- tool_call.arguments | tojson }}\n            {{- \'}\\n</tool_call>\' }}\n        {%- endfor %}\n        {{- \'<|im_end|>\\n\' }}\n    {%- elif message.role == "tool" %}\n        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n            {{- \'<|im_start|>user\' }}\n        {%- endif %}\n        {{- \'\\n<tool_response>\\n\' }}\n        {{- message.content }}\n        {{- \'\\n</tool_response>\' }}\n        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n            {{- \'<|im_end|>\\n\' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- \'<|im_start|>assistant\\n\' }}\n{%- endif %}\n'
QWEN25_TOOL_TOKENS = ["<tool_call>", "</tool_call>"]

# Qwen3's own chat template (Apache-2.0, Qwen; the copy llama.cpp's models/templates carries): thoughts
# in <think></think> ahead of the answer, sent back as reasoning_content, `enable_thinking` false
# writing an empty block into the prompt. Qwen3-2507 "Thinking" models open the block in the prompt
QWEN3_TEMPLATE = (Path(__file__).parent / "templates" / "qwen3.jinja").read_text()
QWEN3_OPENED_TEMPLATE = QWEN3_TEMPLATE.replace(
    "{{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}",
    "{{- '<|im_start|>assistant\\n<think>\\n' }}")
assert QWEN3_OPENED_TEMPLATE != QWEN3_TEMPLATE
QWEN3_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]

# family -> (transformers config class, config overrides, chat template, added special tokens)
FAMILIES = {
    # Llama 3.1: llama3 rope scaling, rope_theta 500000, tied embeddings (as the 1B / 3B are)
    "llama": ("LlamaConfig", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 64},
                                  max_position_embeddings=1024, tie_word_embeddings=True),
              LLAMA3_TEMPLATE, LLAMA3_TOKENS),
    "mistral": ("MistralConfig", dict(sliding_window=4096, max_position_embeddings=32768), MISTRAL_TEMPLATE, []),
    # Qwen2.5: q/k/v biases, tied embeddings on the small ones
    "qwen2": ("Qwen2Config", dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                                  tie_word_embeddings=True), QWEN_TEMPLATE, []),
    # Qwen3: per-head q/k norms, an explicit head_dim that is not hidden_size / heads
    "qwen3": ("Qwen3Config", dict(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
              QWEN_TEMPLATE, []),
    # Qwen3 with its real chat template, thought and tool-call tokens: the reasoning tests' models
    "qwen3-think": ("Qwen3Config", dict(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
                    QWEN3_TEMPLATE, QWEN3_TOKENS),
    "qwen3-opened": ("Qwen3Config", dict(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
                     QWEN3_OPENED_TEMPLATE, QWEN3_TOKENS),
    # Qwen2.5 with its real chat template and tool-call tokens: the tool-call tests' model
    "qwen2-tools": ("Qwen2Config", dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                                        tie_word_embeddings=True), QWEN25_TOOLS_TEMPLATE, QWEN25_TOOL_TOKENS),
}


def bundled_tokenizer_json() -> str:
    """The bundled model's tokenizer as a ``tokenizer.json`` text."""
    from agentspec.backends.embedded.weights import load_checkpoint

    return load_checkpoint(quiet=True).tokenizer.backend.to_str()


# the pre-tokenizer each family's real tokenizer.json has (GGUF: tokenizer.ggml.pre); transformers
# 5 rebuilds Qwen's and Llama's from the model type, so the fixture must carry the family's own
PRE = {"llama": "llama-bpe", "mistral": "smollm", "qwen2": "qwen2", "qwen3": "qwen2", "qwen2-tools": "qwen2",
       "qwen3-think": "qwen2", "qwen3-opened": "qwen2"}


def write_tokenizer(folder: Path, template: str, added: list[str], eos: str, family: str = "mistral",
                    vocab_size: int | None = None) -> int:
    """tokenizer.json (+ ``added`` special tokens), tokenizer_config.json; returns the vocab size.
    ``vocab_size``: pad the vocabulary to this many with unused special tokens (a real model's shape)."""
    from tokenizers import AddedToken, Tokenizer

    from agentspec.backends.tokenizer import _pre_tokenizer

    tok = Tokenizer.from_str(bundled_tokenizer_json())
    tok.pre_tokenizer = _pre_tokenizer(PRE[family])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in added])
    if vocab_size is not None:
        n = tok.get_vocab_size(with_added_tokens=True)
        tok.add_special_tokens([AddedToken(f"<|unused_{i}|>", normalized=False, special=True)
                                for i in range(vocab_size - n)])
    tok.save(str(folder / "tokenizer.json"))
    bos = "<|begin_of_text|>" if "<|begin_of_text|>" in added else "<|im_start|>"
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, "bos_token": bos,
           "eos_token": eos, "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "add_bos_token": False,
           "model_max_length": 4096}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tok.get_vocab_size(with_added_tokens=True)


def write_family(folder: Path, family: str, *, dim: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 hidden: int = 256, seed: int = 0, init_std: float = 0.08, shards: bool = False,
                 dtype: torch.dtype = torch.float32, vocab_size: int | None = None, build_dtype=torch.float32,
                 **overrides) -> Path:
    """A ``family`` checkpoint with random weights in ``folder`` (config, safetensors, tokenizer).
    ``vocab_size``: pad the tokenizer to it; ``build_dtype``: the dtype transformers builds the
    model in (bfloat16 for real sizes, where float32 would not fit)."""
    import transformers

    cls_name, extra, template, added = FAMILIES[family]
    folder.mkdir(parents=True, exist_ok=True)
    eos = "<|eot_id|>" if family == "llama" else "<|im_end|>"
    vocab = write_tokenizer(folder, template, added, eos, family, vocab_size)
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos_ids = [ids.token_to_id(eos)]
    bos_id = ids.token_to_id("<|begin_of_text|>" if family == "llama" else "<|im_start|>")
    cfg = getattr(transformers, cls_name)(
        bos_token_id=bos_id, eos_token_id=eos_ids[0], hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=hidden, vocab_size=vocab, initializer_range=init_std, rms_norm_eps=1e-6,
        **{**extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=build_dtype)
    with torch.no_grad():  # norms and biases away from their init (ones, zeros), so a misread shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
    model.to(dtype).save_pretrained(str(folder), max_shard_size="1MB" if shards else "10GB")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    return folder


# ------------------------------------------------------------------------------------------
# GGUF

def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (Hugging Face rotate_half halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_FP16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2)}


def random_quantized(rows: int, cols: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of GGUF type ``qtype`` for a ``[rows, cols]`` tensor (uint8, GGUF's layout),
    with their float16 scales set to small finite values."""
    import gguf

    qt = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in _FP16_FIELDS[qtype]:
        scale = rng.uniform(0.5e-4, 2e-4, size=(rows, cols // block)).astype(np.float16)
        raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, cols // block * size)


def write_gguf(hf_folder: Path, path: Path, *, qtype: str = "F32", tensor_types: dict[str, str] | None = None) -> Path:
    """The checkpoint in ``hf_folder`` as a GGUF file (llama.cpp's names; Q/K rows permuted for
    Llama). ``qtype``: the type of every 2-D weight (F32, F16, BF16, Q8_0, Q4_0, Q4_1 quantized
    from the weights). For the K-quants use ``write_quantized_pair``."""
    import gguf
    from gguf.quants import quantize
    from safetensors.torch import load_file

    cfg = json.loads((hf_folder / "config.json").read_text())
    state: dict[str, np.ndarray] = {}
    for f in sorted(hf_folder.glob("*.safetensors")):   # torch: bfloat16 folders too
        state.update({k.removeprefix("model."): v.float().numpy() for k, v in load_file(str(f)).items()})
    return _write_gguf(cfg, hf_folder, state, path, lambda name, w: (
        quantize(w, gguf.GGMLQuantizationType[qtype]) if w.ndim == 2 and qtype != "F32" else w,
        gguf.GGMLQuantizationType[qtype] if w.ndim == 2 else gguf.GGMLQuantizationType.F32))


def _write_gguf(cfg: dict, hf_folder: Path, state: dict[str, np.ndarray], path: Path, encode) -> Path:
    import gguf

    family = cfg["model_type"]
    arch = "llama" if family in ("llama", "mistral") else family
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if family == "mistral" and cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    # tokenizer: the HF folder's vocabulary as llama.cpp's gpt2 BPE fields
    tok = json.loads((hf_folder / "tokenizer.json").read_text())
    tcfg = json.loads((hf_folder / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    for t in tok.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in tok.get("added_tokens", []) if t.get("special")}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(PRE[family])
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    merges = tok["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_eos_token_id(vocab[tcfg["eos_token"]])
    w.add_bos_token_id(vocab[tcfg["bos_token"]])
    w.add_chat_template(tcfg["chat_template"])
    if "<|eot_id|>" in vocab:
        w.add_eot_token_id(vocab["<|eot_id|>"])
    if family == "llama" and rope.get("rope_type") == "llama3":  # as llama.cpp's converter writes it
        from agentspec.kernels import rope as rope_mod

        base = rope_mod.inv_freq(rope["rope_theta"], head_dim)
        scaled = rope_mod.inv_freq(rope["rope_theta"], head_dim, rope)
        state["rope_freqs.weight"] = (base / scaled).numpy().astype(np.float32)

    def put(name, arr, src=None):
        data, qt = encode(src, arr)
        shape = arr.shape if qt in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) else None
        if shape is not None:
            w.add_tensor(name, data.astype(np.float16) if qt == gguf.GGMLQuantizationType.F16 else data)
        else:
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qt)

    put("token_embd.weight", state["embed_tokens.weight"], "embed_tokens.weight")
    put("output_norm.weight", state["norm.weight"])
    if not cfg.get("tie_word_embeddings") and "lm_head.weight" in state:
        put("output.weight", state["lm_head.weight"], "lm_head.weight")
    if "rope_freqs.weight" in state:
        put("rope_freqs.weight", state["rope_freqs.weight"])
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"layers.{i}.", f"blk.{i}."
        q, k = state[p + "self_attn.q_proj.weight"], state[p + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = _permute(q, heads), _permute(k, kv)
        put(b + "attn_q.weight", q, p + "self_attn.q_proj.weight")
        put(b + "attn_k.weight", k, p + "self_attn.k_proj.weight")
        put(b + "attn_v.weight", state[p + "self_attn.v_proj.weight"], p + "self_attn.v_proj.weight")
        put(b + "attn_output.weight", state[p + "self_attn.o_proj.weight"], p + "self_attn.o_proj.weight")
        for proj in ("q", "k", "v"):
            if p + f"self_attn.{proj}_proj.bias" in state:
                put(b + f"attn_{proj}.bias", state[p + f"self_attn.{proj}_proj.bias"])
        if p + "self_attn.q_norm.weight" in state:
            put(b + "attn_q_norm.weight", state[p + "self_attn.q_norm.weight"])
            put(b + "attn_k_norm.weight", state[p + "self_attn.k_norm.weight"])
        put(b + "attn_norm.weight", state[p + "input_layernorm.weight"])
        put(b + "ffn_norm.weight", state[p + "post_attention_layernorm.weight"])
        for ours, theirs in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
            put(b + ours + ".weight", state[p + f"mlp.{theirs}.weight"], p + f"mlp.{theirs}.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_quantized_pair(hf_folder: Path, path: Path, qtypes: dict[str, str], seed: int = 0) -> Path:
    """Replace the 2-D weights of ``hf_folder``'s checkpoint by random K-quant blocks
    (``qtypes``: GGUF name suffix, e.g. ``"ffn_down.weight"`` -> ``"Q6_K"``; the rest Q4_K): the
    GGUF file gets the blocks, the Hugging Face folder their dequantization by the ``gguf``
    package (the reference), so both hold the same weights."""
    import gguf
    from gguf.quants import dequantize
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(seed)
    cfg = json.loads((hf_folder / "config.json").read_text())
    files = sorted(hf_folder.glob("*.safetensors"))
    state = {}
    for f in files:
        state.update({k.removeprefix("model."): v.astype(np.float32) for k, v in load_file(str(f)).items()})
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    arch_llama = cfg["model_type"] in ("llama", "mistral")
    blocks: dict[str, tuple[np.ndarray, str]] = {}
    gguf_names = {"embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
                  "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                  "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
                  "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                  "mlp.down_proj.weight": "ffn_down.weight"}
    for name, w in list(state.items()):
        if w.ndim != 2:
            continue
        short = gguf_names.get(name) or gguf_names[name.split(".", 2)[-1]]
        qtype = next((q for suffix, q in qtypes.items() if short.endswith(suffix)), "Q4_K")
        raw = random_quantized(w.shape[0], w.shape[1], qtype, rng)
        deq = dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(w.shape).astype(np.float32)
        blocks[name] = (raw, qtype)
        if arch_llama and name.endswith(("q_proj.weight", "k_proj.weight")):
            # the blocks are in GGUF (permuted) row order; the HF weight is their un-permuted rows
            n = heads if name.endswith("q_proj.weight") else kv
            deq = deq.reshape(n, deq.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(deq.shape)
        state[name] = deq
    for f in files:
        f.unlink()
    (hf_folder / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file({("lm_head.weight" if k == "lm_head.weight" else "model." + k): v for k, v in state.items()},
              str(hf_folder / "model.safetensors"), metadata={"format": "pt"})

    def encode(src, arr):
        if src in blocks:
            raw, qtype = blocks[src]
            return raw, gguf.GGMLQuantizationType[qtype]
        return arr, gguf.GGMLQuantizationType.F32

    return _write_gguf(cfg, hf_folder, dict(state), path, encode)
