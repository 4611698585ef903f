"""Tokenizers: byte-level BPE from a GGUF file's metadata or a tokenizer.json, and a
plain byte tokenizer for random-weight models.

All of them expose encode(str) -> list[int], decode(ids) -> str, bos_id, eos_id, and
apply_chat_template(messages) when the model ships a template.
"""

from __future__ import annotations

from pathlib import Path


class Tokenizer:
    """Wraps a Hugging Face `tokenizers.Tokenizer` (the Rust library, no transformers)."""

    def __init__(self, backend, bos_id: int | None, eos_id: int | None, chat_template: str | None = None,
                 add_bos: bool = False):
        self.backend = backend
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.chat_template = chat_template
        self.add_bos = add_bos

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

    def decode(self, ids) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass plain text instead")
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(messages=messages,
                                                         add_generation_prompt=add_generation_prompt)

    @classmethod
    def from_gguf_fields(cls, fields: dict) -> Tokenizer:
        """Byte-level BPE ("gpt2" in GGUF terms) from the metadata of a GGUF file."""
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as Backend

        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2 byte-level BPE)")
        tokens = fields["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        backend = Backend(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                     fuse_unk=False, byte_fallback=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if fields.get("tokenizer.ggml.pre") == "smollm":
            # SmolLM's vocabulary was learned with every digit split off on its own.
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level])
        else:
            backend.pre_tokenizer = byte_level
        backend.decoder = decoders.ByteLevel()
        types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
        backend.add_special_tokens(specials)
        return cls(backend, fields.get("tokenizer.ggml.bos_token_id"), fields.get("tokenizer.ggml.eos_token_id"),
                   fields.get("tokenizer.chat_template"), bool(fields.get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_directory(cls, folder: Path, bos_id: int | None, eos_id: int | None) -> Tokenizer:
        """tokenizer.json (+ tokenizer_config.json for the chat template and BOS policy)."""
        import json

        from tokenizers import Tokenizer as Backend

        backend = Backend.from_file(str(folder / "tokenizer.json"))
        config = {}
        if (folder / "tokenizer_config.json").is_file():
            config = json.loads((folder / "tokenizer_config.json").read_text())
        return cls(backend, bos_id, eos_id, config.get("chat_template"), bool(config.get("add_bos_token", False)))


class ByteTokenizer:
    """Bytes 0..255 are tokens 3..258; 0, 1, 2 are pad, BOS, EOS. For random-weight models,
    whose outputs are meaningless anyway: any text encodes, any id decodes."""

    offset = 3

    def __init__(self, vocab_size: int):
        if vocab_size < 256 + self.offset:
            raise ValueError(f"a byte tokenizer needs a vocabulary of at least 259, got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_id, self.eos_id = 1, 2
        self.chat_template = None

    def encode(self, text: str) -> list[int]:
        return [self.bos_id] + [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        data = bytes(int(i) - self.offset for i in ids if self.offset <= int(i) < 256 + self.offset)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        raise ValueError("random-weight models have no chat template; pass plain text instead")
