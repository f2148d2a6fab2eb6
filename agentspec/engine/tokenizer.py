"""Tokenizer and chat template, from a GGUF vocabulary or a Hugging Face ``tokenizer.json``.

The BPE itself is Hugging Face ``tokenizers`` (Rust); this module only builds it from what the
checkpoint carries and renders the checkpoint's own Jinja chat template.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

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
    ) -> None:
        self.backend = backend
        eos_list = [int(t) for t in eos_token_ids]
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
    ) -> "Tokenizer":
        if model != "gpt2":
            from ..errors import ModelLoadError

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
        eos = [eos_token_id] if eos_token_id is not None else []
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
                       chat_template=meta["chat_template"], add_bos=meta["add_bos"])
        return cls._from_hf_folder(backend, directory)

    @classmethod
    def _from_hf_folder(cls, backend: _HFTokenizer, directory: Path) -> "Tokenizer":
        cfg = _read_json(directory / "tokenizer_config.json")
        gen = _read_json(directory / "generation_config.json")
        model_cfg = _read_json(directory / "config.json")
        template = cfg.get("chat_template")
        if (directory / "chat_template.jinja").exists():
            template = (directory / "chat_template.jinja").read_text()
        eos: list[int] = []
        eos_tok = cfg.get("eos_token")
        if isinstance(eos_tok, dict):
            eos_tok = eos_tok.get("content")
        if isinstance(eos_tok, str) and backend.token_to_id(eos_tok) is not None:
            eos.append(backend.token_to_id(eos_tok))
        for source in (gen.get("eos_token_id"), model_cfg.get("eos_token_id")):
            for x in ([source] if isinstance(source, int) else source if isinstance(source, list) else []):
                if int(x) not in eos:
                    eos.append(int(x))
        bos = model_cfg.get("bos_token_id")
        return cls(backend, eos_token_ids=eos, bos_token_id=bos if isinstance(bos, int) else None,
                   chat_template=template, add_bos=bool(cfg.get("add_bos_token", False)))

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

    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> str:
        """Render ``[{"role", "content"}, ...]`` with the model's template (as transformers does)."""
        if self.chat_template is None:
            # no template: a plain transcript, so that a base model still gets something sensible
            body = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return body + ("assistant: " if add_generation_prompt else "")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(self.chat_template)
        bos = self.token_text(self.bos_token_id) if self.bos_token_id is not None else ""
        eos_id = self.eos_token_id
        return self._template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=bos or "", eos_token=(self.token_text(eos_id) if eos_id is not None else "") or "",
        )


def _raise_template_error(message: str):
    raise ValueError(f"chat template error: {message}")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
