"""Real English text that exists offline (the license texts Debian ships), and prompts of
exact token lengths cut from it."""

from __future__ import annotations

from pathlib import Path

TEXT_SOURCES = ("/usr/share/common-licenses/Apache-2.0", "/usr/share/common-licenses/GPL-3")


def sample_text() -> str:
    """English text available offline (a license text), for prompts of any length."""
    for p in TEXT_SOURCES:
        if Path(p).is_file():
            return Path(p).read_text()
    return "The quick brown fox jumps over the lazy dog. " * 400


def sample_prompts(tokenizer, prompt_len: int, batch: int) -> list[list[int]]:
    """`batch` different prompts of exactly prompt_len tokens, cut from the sample text."""
    ids = tokenizer.encode(sample_text())
    while len(ids) < prompt_len + 37 * batch:
        ids = ids + ids
    return [ids[37 * b: 37 * b + prompt_len] for b in range(batch)]
