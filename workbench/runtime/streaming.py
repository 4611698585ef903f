"""Printing a generation as it happens: generate(on_token=TextStream(tokenizer)).

Tokens are decoded together, not one by one (a character can span several byte-level
tokens), and only the new part of the text is written each step."""

from __future__ import annotations

import sys
from typing import TextIO


class TextStream:
    """on_token hook: writes sequence `index`'s new text to `out` (stdout by default)."""

    def __init__(self, tokenizer, out: TextIO | None = None, index: int = 0):
        self.tokenizer = tokenizer
        self.out = out
        self.index = index
        self.ids: list[int] = []
        self.text = ""

    def __call__(self, step: int, ids: list[int]) -> None:
        token = ids[self.index]
        if token in self.tokenizer.stop_ids:
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        out = self.out or sys.stdout  # looked up per call: IPython swaps stdout per cell
        out.write(text[len(self.text):])
        if getattr(out, "flush_interval", None) is None:
            out.flush()  # a terminal or a pipe: shown now, token by token
        # else a Jupyter kernel's stream (ipykernel's OutStream), which sends what was written at
        # most every flush_interval (0.2 s) from its own thread. A flush there blocks this thread
        # until that thread has sent it, and sends one message per token for the browser to
        # draw: on a 2-core machine that cost the notebook a fifth of its decode tokens/s
        # (bench/notebooks.py --generate-speed).
        self.text = text
