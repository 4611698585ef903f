"""Tokenizers: byte-level BPE from a GGUF file's metadata or a tokenizer.json, and a
plain byte tokenizer for random-weight models.

All of them expose encode(str) -> list[int], decode(ids) -> str, bos_id, eos_id, and
apply_chat_template(messages) when the model ships a template.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from workbench.cache import cache_dir


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

    @property
    def stop_ids(self) -> frozenset[int]:
        """Tokens that end a reply: the EOS token, and the end-of-turn token of the chat formats
        whose vocabulary this is (Gemma's <end_of_turn>, ChatML's <|im_end|>, Llama 3's
        <|eot_id|>, Phi's <|end|>), as llama.cpp stops at its end-of-generation tokens."""
        if not hasattr(self, "_stop_ids"):
            found = (self.backend.token_to_id(t) for t in END_OF_TURN)
            self._stop_ids = frozenset(i for i in (self.eos_id, *found) if i is not None)
        return self._stop_ids

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

    def decode(self, ids) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation as the model's own template writes it (Jinja, as transformers and
        llama.cpp render it: bos_token / eos_token, raise_exception and strftime_now defined).
        A template that writes the BOS token itself gets no second one from encode()."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass plain text instead")
        import datetime

        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
        token = (lambda i: self.backend.id_to_token(i) if i is not None else "")
        try:
            text = env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=token(self.bos_id),
                eos_token=token(self.eos_id))
        except jinja2.TemplateError as e:
            raise ValueError(f"the model's chat template failed: {e}") from None
        bos = token(self.bos_id)
        if self.add_bos and bos and text.startswith(bos):
            text = text[len(bos):]  # encode() adds it
        return text

    @classmethod
    def from_gguf_fields(cls, fields: dict) -> Tokenizer:
        """The tokenizer in a GGUF file's metadata: byte-level BPE ("gpt2": Llama 3, Qwen,
        SmolLM) or SentencePiece BPE ("llama": Llama 2, Gemma, Phi-3)."""
        kind = fields.get("tokenizer.ggml.model")
        build = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}.get(kind)
        if build is None:
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2 byte-level BPE, "
                             f"llama SentencePiece BPE)")
        tokens = fields["tokenizer.ggml.tokens"]
        types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        backend = build(fields, tokens, types)
        return cls(backend, fields.get("tokenizer.ggml.bos_token_id"), fields.get("tokenizer.ggml.eos_token_id"),
                   fields.get("tokenizer.chat_template"), bool(fields.get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_directory(cls, folder: Path, bos_id: int | None, eos_id: int | None) -> Tokenizer:
        """tokenizer.json (+ tokenizer_config.json for the chat template and BOS policy; the
        template may be its own chat_template.jinja file, as transformers 5 saves it)."""
        from tokenizers import Tokenizer as Backend

        backend = Backend.from_file(str(folder / "tokenizer.json"))
        config = {}
        if (folder / "tokenizer_config.json").is_file():
            config = json.loads((folder / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        return cls(backend, bos_id, eos_id, template, bool(config.get("add_bos_token", False)))


# End-of-turn tokens of the common chat formats (Tokenizer.stop_ids).
END_OF_TURN = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|endoftext|>")

# GGUF token types (llama.cpp's llama_token_type)
_NORMAL, _CONTROL, _USER_DEFINED, _BYTE = 1, 3, 4, 6


def _byte_level_bpe(fields: dict, tokens: list[str], types: list[int]):
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

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
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _CONTROL])
    return backend


def _sentencepiece_bpe(fields: dict, tokens: list[str], types: list[int]):
    """SentencePiece's BPE as llama.cpp runs it: spaces become U+2581, then the adjacent pair
    whose joined piece scores highest is merged until none is in the vocabulary; characters
    outside it become their UTF-8 bytes' <0xNN> tokens. The same as BPE whose merges are
    every split (left, right) of every normal piece, ranked by the joined piece's score.
    Control tokens (<bos>, <start_of_turn>) and user-defined ones (Gemma's runs of newlines)
    match whole in the text. Building the merges of a large vocabulary takes seconds, so the
    result is kept in the workbench cache under a hash of what it is built from."""
    from tokenizers import Tokenizer as Backend

    scores = fields.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
    prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    unk = fields.get("tokenizer.ggml.unknown_token_id")
    key = hashlib.sha256(json.dumps([tokens, types, scores, prefix, unk, _SPM_VERSION]).encode()).hexdigest()[:24]
    path = cache_dir() / "tokenizers" / f"spm-{key}.json"
    if path.is_file():
        try:
            return Backend.from_file(str(path))
        except Exception:  # a damaged cache entry is rebuilt
            pass
    backend = _build_sentencepiece_bpe(tokens, types, scores, prefix, unk)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        backend.save(str(tmp))
        os.replace(tmp, path)  # whole or not at all: another process may be loading the same model
    except OSError:
        pass  # a read-only cache only costs the rebuild next time
    return backend


_SPM_VERSION = 1  # bump when _build_sentencepiece_bpe changes what it builds


def _build_sentencepiece_bpe(tokens: list[str], types: list[int], scores: list[float], prefix: bool,
                             unk: int | None):
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as Backend

    vocab = {t: i for i, t in enumerate(tokens)}
    mergeable = {t for t, ty in zip(tokens, types) if ty == _NORMAL}
    ranked = []
    for token, ty, score in zip(tokens, types, scores):
        if ty != _NORMAL or len(token) < 2:
            continue
        splits = [(token[:i], token[i:]) for i in range(1, len(token))
                  if token[:i] in mergeable and token[i:] in mergeable]
        if len(splits) > 1:
            splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        ranked += [(-score, left, right) for left, right in splits]
    ranked.sort(key=lambda m: m[0])  # stable: equal scores keep the vocabulary's order
    backend = Backend(models.BPE(vocab=vocab, merges=[(left, right) for _, left, right in ranked],
                                 unk_token=tokens[unk] if unk is not None else None, fuse_unk=True,
                                 byte_fallback=True))
    space = "\u2581"
    steps = [normalizers.Replace(" ", space)]
    if prefix:
        steps.insert(0, normalizers.Prepend(space))
    backend.normalizer = normalizers.Sequence(steps)
    strip = [decoders.Strip(" ", 1, 0)] if prefix else []
    backend.decoder = decoders.Sequence([decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *strip])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    return backend


class ByteTokenizer:
    """Bytes 0..255 are tokens 3..258; 0, 1, 2 are pad, BOS, EOS. For random-weight models,
    whose outputs are meaningless anyway: any text encodes, any id decodes."""

    offset = 3

    def __init__(self, vocab_size: int):
        if vocab_size < 256 + self.offset:
            raise ValueError(f"a byte tokenizer needs a vocabulary of at least 259, got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_id, self.eos_id = 1, 2
        self.stop_ids = frozenset({self.eos_id})
        self.chat_template = None

    def encode(self, text: str) -> list[int]:
        return [self.bos_id] + [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        data = bytes(int(i) - self.offset for i in ids if self.offset <= int(i) < 256 + self.offset)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        raise ValueError("random-weight models have no chat template; pass plain text instead")
