"""Real English text that exists offline (the license texts Debian ships), and prompts of
exact token lengths cut from it."""

from __future__ import annotations

from pathlib import Path

TEXT_SOURCES = ("/usr/share/common-licenses/Apache-2.0", "/usr/share/common-licenses/GPL-3")
LICENSES = Path("/usr/share/common-licenses")


def license_corpus() -> tuple[str, list[str]]:
    """Every license text Debian ships (/usr/share/common-licenses, each file once, symlinks
    skipped, sorted by name) joined: about 100k tokens of real English. Returns the text and
    the files it came from; falls back to sample_text() where the folder is missing."""
    files = sorted(p for p in LICENSES.glob("*") if p.is_file() and not p.is_symlink()) if LICENSES.is_dir() else []
    if not files:
        return sample_text(), ["a built-in sentence"]
    return "\n\n".join(p.read_text(errors="replace") for p in files), [str(p) for p in files]


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
