"""Tokenizer and chat template, from a GGUF vocabulary or a Hugging Face ``tokenizer.json``.

The BPE itself is Hugging Face ``tokenizers`` (Rust); this module only builds it from what the
checkpoint carries and renders the checkpoint's own Jinja chat template.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from datetime import datetime

import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

__all__ = ["Tokenizer"]

# Pre-tokenizer regexes by GGUF ``tokenizer.ggml.pre`` (as llama.cpp's llama-vocab.cpp splits).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str | None):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        # digits one by one, then the GPT-2 split (llama.cpp: "\p{N}" + gpt2 regex)
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3", "pixtral"):
        split = _LLAMA3_SPLIT
    elif pre in ("qwen2", "deepseek-r1-qwen"):
        split = _QWEN2_SPLIT
    else:  # "gpt2", "default" and anything unknown: the GPT-2 regex
        return byte_level
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


class Tokenizer:
    """Encode/decode text and render chat messages with the model's template."""

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        eos_token_ids: Iterable[int],
        bos_token_id: int | None = None,
        chat_template: str | None = None,
        add_bos: bool = False,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self.backend = backend
        eos_list = [int(t) for t in eos_token_ids]
        for t in _end_of_turn_ids(backend, chat_template):  # the template's own end-of-turn tokens
            if t not in eos_list:
                eos_list.append(t)
        # bos_token, eos_token, pad_token, unk_token as the template sees them (tokenizer_config)
        self.special_tokens = dict(special_tokens or {})
        self.eos_token_id = eos_list[0] if eos_list else None  # the one templates call eos_token
        self.eos_token_ids = frozenset(eos_list)
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._template = None

    # -- building ---------------------------------------------------------------------------
    @classmethod
    def from_gguf_fields(
        cls,
        *,
        model: str,
        pre: str | None,
        tokens: Sequence[str],
        token_types: Sequence[int] | None,
        merges: Sequence[str],
        eos_token_id: int | None,
        bos_token_id: int | None,
        chat_template: str | None,
        add_bos: bool,
        eot_token_id: int | None = None,
        eom_token_id: int | None = None,
    ) -> "Tokenizer":
        if model != "gpt2":
            from ...errors import ModelLoadError

            raise ModelLoadError(
                f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')"
            )
        vocab = {tok: i for i, tok in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False)
        backend = _HFTokenizer(bpe)
        backend.pre_tokenizer = _pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        if token_types is not None:
            control = [t for t, ty in zip(tokens, token_types) if ty == 3]  # 3 = CONTROL
            backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
            # 4 = USER_DEFINED: added tokens that are text, not control (Qwen's <tool_call>, </tool_call>):
            # one token wherever the text holds them, as the Hugging Face tokenizer and llama.cpp encode them
            user = [t for t, ty in zip(tokens, token_types) if ty == 4]
            backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
        eos = [t for t in (eos_token_id, eot_token_id, eom_token_id) if t is not None]
        end_of_text = vocab.get("<|endoftext|>")
        if end_of_text is not None and end_of_text not in eos:
            eos.append(end_of_text)
        return cls(backend, eos_token_ids=eos, bos_token_id=bos_token_id,
                   chat_template=chat_template, add_bos=add_bos)

    def save(self, directory: Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_meta.json`` into ``directory``."""
        self.backend.save(str(directory / "tokenizer.json"))
        meta = {
            "eos_token_ids": [self.eos_token_id, *sorted(self.eos_token_ids - {self.eos_token_id})]
            if self.eos_token_id is not None else [],
            "bos_token_id": self.bos_token_id,
            "chat_template": self.chat_template,
            "add_bos": self.add_bos,
            "special_tokens": self.special_tokens,
        }
        (directory / "tokenizer_meta.json").write_text(json.dumps(meta))

    @classmethod
    def load(cls, directory: Path) -> "Tokenizer":
        """Load what ``save`` wrote, or a Hugging Face model folder's tokenizer files."""
        backend = _HFTokenizer.from_file(str(directory / "tokenizer.json"))
        meta_path = directory / "tokenizer_meta.json"
        if meta_path.exists():
            meta = json.loads(meta_path.read_text())
            return cls(backend, eos_token_ids=meta["eos_token_ids"], bos_token_id=meta["bos_token_id"],
                       chat_template=meta["chat_template"], add_bos=meta["add_bos"],
                       special_tokens=meta.get("special_tokens"))
        return cls._from_hf_folder(backend, directory)

    @classmethod
    def _from_hf_folder(cls, backend: _HFTokenizer, directory: Path) -> "Tokenizer":
        cfg = _read_json(directory / "tokenizer_config.json")
        gen = _read_json(directory / "generation_config.json")
        model_cfg = _read_json(directory / "config.json")
        template = cfg.get("chat_template")
        if (directory / "chat_template.jinja").exists():
            template = (directory / "chat_template.jinja").read_text()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default", next(iter(named.values()), None))
        special: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            v = cfg.get(key)
            v = v.get("content") if isinstance(v, dict) else v
            if isinstance(v, str):
                special[key] = v
        eos: list[int] = []
        eos_tok = special.get("eos_token")
        if isinstance(eos_tok, str) and backend.token_to_id(eos_tok) is not None:
            eos.append(backend.token_to_id(eos_tok))
        for source in (gen.get("eos_token_id"), model_cfg.get("eos_token_id")):
            for x in ([source] if isinstance(source, int) else source if isinstance(source, list) else []):
                if int(x) not in eos:
                    eos.append(int(x))
        bos = model_cfg.get("bos_token_id")
        if not isinstance(bos, int) and special.get("bos_token"):
            bos = backend.token_to_id(special["bos_token"])
        return cls(backend, eos_token_ids=eos, bos_token_id=bos if isinstance(bos, int) else None,
                   chat_template=template, add_bos=bool(cfg.get("add_bos_token", False)), special_tokens=special)

    # -- use --------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids for many texts at once (the backend encodes them in parallel)."""
        out = [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]
        if self.add_bos and self.bos_token_id is not None:
            out = [[self.bos_token_id, *ids] for ids in out]
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def token_text(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                            tools: Sequence[dict] | None = None, **kwargs: Any) -> str:
        """Render ``[{"role", "content"}, ...]`` (and ``tools``, OpenAI function tools) with the
        model's template (as transformers does). ``kwargs``: the template's own variables
        (``enable_thinking``), as transformers passes them."""
        if self.chat_template is None:
            # no template: a plain transcript, so that a base model still gets something sensible
            body = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return body + ("assistant: " if add_generation_prompt else "")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        bos = self.token_text(self.bos_token_id) if self.bos_token_id is not None else ""
        eos_id = self.eos_token_id
        # as transformers renders it: the special tokens of tokenizer_config, then the call's own
        variables = {"bos_token": bos or "", "eos_token": (self.token_text(eos_id) if eos_id is not None else "") or "",
                     **self.special_tokens, **kwargs}
        try:
            return self._template.render(messages=[dict(m) for m in messages], tools=list(tools) if tools else None,
                                         documents=None,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from None


def _raise_template_error(message: str):
    raise jinja2.TemplateError(message)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _compile_template(source: str):
    """The chat template compiled in the environment transformers' ``apply_chat_template`` uses:
    sandboxed, ``trim_blocks`` / ``lstrip_blocks``, loop controls, its ``tojson`` (no HTML
    escaping, unicode kept), ``raise_exception`` and ``strftime_now``."""

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not parse: {e}") from None


# tokens that end a turn in the chat templates of the families served (Qwen / SmolLM, Llama 3,
# Phi, Gemma, Mistral / Llama 2): a stop wherever the model's template writes one
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")


def _end_of_turn_ids(backend: _HFTokenizer, template: str | None) -> list[int]:
    if not template:
        return []
    out = []
    for text in _END_OF_TURN:
        tid = backend.token_to_id(text)
        if tid is not None and text in template:
            out.append(tid)
    return out


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
