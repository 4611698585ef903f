"""The runtime end to end: the bundled model against Hugging Face transformers, batched
ragged prompts against the plain reference, the int8 KV cache's quality, and every way
loading can fail.

Tolerances: our model and transformers compute the same fp32 network with different
summation orders over 30 layers; measured max |logit difference| is ~5e-5 with logits up
to ~30, so 5e-4 absolute leaves room for other BLAS builds while still catching any real
divergence (a wrong RoPE layout or norm shows up as differences of order 1).
"""

from __future__ import annotations

import math

import json
from pathlib import Path

import pytest
import torch

import background
import workbench as wb
from workbench.analysis.forcing import forced_logits
from workbench.model.kv_formats import KV_FORMATS, parse_kv
from workbench.model.loaders import ModelLoadError, bundled_gguf_path
from workbench.model.switches import Switches
from workbench.model.weights import WEIGHT_FORMATS
from workbench.model.timing import PART_NAMES

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Licensed under the Apache License, Version 2.0, you may not use this file except",
]


@pytest.fixture(scope="module")
def model():
    """The bundled model in fp32 (its Q4_1 blocks dequantized exactly): the path these tests
    hold to transformers' fp32 at fp32 rounding. The file's own blocks (the default load) are
    held to the same model in tests/test_gguf_weights.py."""
    return wb.load_model("smollm2-135m", dtype="fp32")


prepare_in_background = background.peer_files  # the GGUF as transformers decodes it, written once


@pytest.fixture(scope="module")
def hf_model():
    """transformers' model of the bundled GGUF: its own GGUF decoding, saved once as a Hugging
    Face directory (workbench.analysis.peers.hf_directory, which tests/test_peers.py checks)."""
    transformers = pytest.importorskip("transformers")
    background.result(prepare_in_background)
    from workbench.analysis.peers import hf_directory

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_directory()), dtype=torch.float32)
    return hf.eval()


@pytest.mark.parametrize("attention", ["slim", "flash", "sdpa", "naive"])
def test_logits_match_transformers(model, hf_model, attention):
    for prompt in PROMPTS:
        ids = model.tokenizer.encode(prompt)
        with torch.inference_mode():
            ref = hf_model(torch.tensor([ids])).logits[0]
        ours = model.logits(ids, attention=attention)
        torch.testing.assert_close(ours, ref, atol=5e-4, rtol=0)


def test_greedy_continuation_matches_transformers(model, hf_model):
    for prompt in PROMPTS[:2]:
        ids = model.tokenizer.encode(prompt)
        with torch.inference_mode():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):]
        out = model.generate(ids, max_new_tokens=32, attention="slim", kv_cache="fp32", stop_at_eos=False)
        ref = ref.tolist()  # transformers stops early at an end-of-text token; compare what it made
        assert len(ref) >= 16
        assert out.token_ids[:len(ref)] == ref


def test_generate_text_and_timings(model):
    out = model.generate("The capital of France is", max_new_tokens=8)
    assert "Paris" in out.text
    t = out.timings
    assert t.prefill is not None and len(t.decode_steps) == len(out.token_ids) - 1
    assert len(t.per_layer("decode")) == model.config.n_layers
    # Behaviour, not speed: the summary is derived from the recorded steps (rates are benchmarks' business).
    s = t.summary()
    decode = t.decode_steps
    assert s["decode_tokens_per_s"] == pytest.approx(t.decode_tokens / t.decode_s)
    assert t.decode_tokens == len(decode)  # one sequence: one token per decode step
    # Rates are totals over totals: all bytes (FLOPs) of the decode steps / their total time.
    decode_s = sum(st.total_s for st in decode)
    assert s["decode_gbps"] == pytest.approx(sum(st.bytes_read for st in decode) / decode_s / 1e9)
    assert s["decode_gflops"] == pytest.approx(sum(st.total_flops for st in decode) / decode_s / 1e9)
    assert s["prefill_ms"] == pytest.approx(1e3 * t.prefill.total_s)
    n_layers = model.config.n_layers
    assert all(set(st.parts_s) == set(PART_NAMES) and len(st.flops) == n_layers for st in t.steps)
    assert all(len(v) == n_layers for st in t.steps for v in st.parts_s.values())


def test_step_flops_count_linears_attention_and_head(model):
    """The FLOP accounting, against the model's shapes written out by hand: every decode
    step does 2 flops per linear weight per sequence, Q K^T and P V over each sequence's
    cached tokens (4 H D per pair), and the LM head for each sequence."""
    cfg = model.config
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    out = model.generate(prompts, max_new_tokens=3, stop_at_eos=False)
    qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim * cfg.dim
    per_token = qkv + cfg.n_heads * cfg.head_dim * cfg.dim + 3 * cfg.ffn_dim * cfg.dim
    head_params = cfg.vocab_size * cfg.dim
    prefill = out.timings.prefill
    pairs = 5 * 6 // 2 + 3 * 4 // 2  # causal: n (n + 1) / 2 per prompt
    assert prefill.flops == [2 * 8 * per_token + 4 * cfg.n_heads * cfg.head_dim * pairs] * cfg.n_layers
    assert prefill.head_flops == 2 * 2 * head_params  # the last token of each of the 2 prompts
    first = out.timings.decode_steps[0]  # sequences now hold 6 and 4 tokens
    assert first.flops == [2 * 2 * per_token + 4 * cfg.n_heads * cfg.head_dim * (6 + 4)] * cfg.n_layers
    assert first.head_flops == 2 * 2 * head_params


def test_switches_change_without_reloading(model):
    weights_before = model.llama.layers[0].wqkv.weight
    out_int8 = model.generate("Hello", max_new_tokens=4, attention="flash", kv_cache="int8")
    assert out_int8.switches == Switches("flash", "int8", "tile")  # as it ran: the format's default kernel
    assert out_int8.switches.kv_text == "int8 (tile)"
    widen = model.generate("Hello", max_new_tokens=4, kv_cache="int8", kv_kernel="widen")
    assert widen.switches.kv_kernel == "widen" and widen.token_ids == out_int8.token_ids[:len(widen.token_ids)]
    model.attention, model.kv_cache = "sdpa", "bf16"
    assert model.generate("Hello", max_new_tokens=4).switches == Switches("sdpa", "bf16", "widen")
    with pytest.raises(ValueError, match="kv_kernel must be one of widen for kv_cache 'bf16', got 'tile'"):
        model.kv_kernel = "tile"
    with pytest.raises(ValueError, match="kv_kernel must be one of tile, dot, widen for kv_cache 'int8', got 'fast'"):
        model.generate("Hello", max_new_tokens=2, kv_cache="int8", kv_kernel="fast")
    assert model.kv_cache == "bf16" and model.kv_kernel is None
    with pytest.raises(ValueError, match="attention must be one of"):
        model.attention = "fast"
    assert model.attention == "sdpa"  # a bad value leaves the switch as it was
    model.attention, model.kv_cache = "slim", "fp32"
    assert model.llama.layers[0].wqkv.weight is weights_before


def test_sampling_is_seeded(model):
    a = model.generate("Once upon a time", max_new_tokens=12, temperature=0.8, top_k=40, top_p=0.9, seed=7)
    b = model.generate("Once upon a time", max_new_tokens=12, temperature=0.8, top_k=40, top_p=0.9, seed=7)
    assert a.token_ids == b.token_ids


def test_chat_template_and_eos(model):
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    out = model.generate(text, max_new_tokens=64)
    # The instruct model ends its answer with <|im_end|> (EOS): generation stops there.
    assert out.token_ids[-1] == model.tokenizer.eos_id or len(out.token_ids) == 64


def teacher_forced_logits(llama, seqs, follow, switches, batched: bool):
    """Teacher-forced logits [B, steps, vocab], all sequences in one batch or one at a time."""
    if batched:
        return forced_logits(llama, seqs, follow, switches)
    return torch.cat([forced_logits(llama, [seqs[i]], follow[i:i + 1], switches) for i in range(len(seqs))])


@pytest.mark.parametrize("attention", ["slim", "flash", "sdpa"])
def test_random_gqa_model_batched_ragged_matches_naive(attention):
    """A random-weight preset with GQA (32 query / 4 KV heads), three prompts of different
    lengths in one batch, against the plain-PyTorch reference run one sequence at a time."""
    m = wb.load_model("tinyllama-1.1b", random=True, layers=2, seed=3)
    assert m.config.n_heads // m.config.n_kv_heads == 8
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 32000, (n,), generator=gen).tolist() for n in (5, 37, 18)]
    follow = torch.randint(3, 32000, (3, 6), generator=gen)
    ours = teacher_forced_logits(m.llama, seqs, follow, Switches(attention, "fp32"), batched=True)
    ref = teacher_forced_logits(m.llama, seqs, follow, Switches("naive", "fp32"), batched=False)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_int8_cache_quality_against_fp32(model):
    """Teacher-forced over real text: the int8 KV cache's next-token distribution stays
    close to the fp32 cache's. Thresholds: top-1 agreement >= 0.95 and mean KL <= 0.02
    nats (measured on this text: agreement 1.0, KL ~3e-4)."""
    text = Path("/usr/share/common-licenses/Apache-2.0").read_text()[:3000]
    ids = model.tokenizer.encode(text)[:160]
    prompt, follow = [ids[:32]], torch.tensor([ids[32:]])
    ref = teacher_forced_logits(model.llama, prompt, follow, Switches("slim", "fp32"), batched=True)[0]
    q8 = teacher_forced_logits(model.llama, prompt, follow, Switches("slim", "int8"), batched=True)[0]
    agree = (ref.argmax(-1) == q8.argmax(-1)).float().mean().item()
    kl = torch.nn.functional.kl_div(q8.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1).mean().item()
    assert agree >= 0.95, agree
    assert kl <= 0.02, kl


# -- failures -----------------------------------------------------------------------------

def test_named_model_without_weights_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_MODELS", str(tmp_path))
    with pytest.raises(ModelLoadError) as e:
        wb.load_model("llama2-7b")
    msg = str(e.value)
    assert "no local weights for llama2-7b" in msg and str(tmp_path) in msg and "--random" in msg


def test_unknown_model_lists_presets():
    with pytest.raises(ModelLoadError, match="llama2-7b"):
        wb.load_model("gpt-17")


def test_memory_estimate_refuses_before_allocating():
    with pytest.raises(ModelLoadError, match="GiB is available"):
        wb.load_model("llama2-70b", random=True, dtype="fp32")


def test_bad_arguments():
    with pytest.raises(ModelLoadError, match="dtype must be one of"):
        wb.load_model("smollm2-135m", dtype="fp8")
    with pytest.raises(ModelLoadError, match="layers must be a positive integer"):
        wb.load_model("llama2-7b", random=True, layers=0)
    with pytest.raises(ValueError, match=r"layers must be in \[1, 32\]"):
        wb.load_model("llama2-7b", random=True, layers=99)


def test_corrupt_and_truncated_files_fail_cleanly_and_the_loaded_model_survives(model, tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + b"\x00\xff" * 100)
    truncated = tmp_path / "truncated.gguf"
    with open(bundled_gguf_path(), "rb") as f:
        truncated.write_bytes(f.read(5_000_000))
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"1234")
    for path in (garbage, truncated, not_gguf):
        with pytest.raises(ModelLoadError):
            wb.load_model(str(path))
    assert "Paris" in model.generate("The capital of France is", max_new_tokens=4).text


def test_unsupported_architecture(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        wb.load_model(str(path))


def test_generate_rejects_bad_arguments(model):
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate("hi", max_new_tokens=0)
    with pytest.raises(ValueError, match="token ids must be in"):
        model.generate([1, 2, 10**6])
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        model.generate("hi", kv_cache="int4")
    with pytest.raises(ValueError, match="exceeds the model's context"):
        model.generate("hi", max_new_tokens=10**5)


def test_hf_directory_and_gguf_path_load_the_same_model(model, tmp_path):
    """Write the bundled model as a Hugging Face directory (config.json, safetensors in HF
    naming and Q/K layout, tokenizer.json), load it back, and get the same logits; load the
    GGUF by path too."""
    from safetensors.torch import save_file

    cfg, llama = model.config, model.llama
    tensors = {"model.embed_tokens.weight": llama.embedding, "model.norm.weight": llama.final_norm}
    for i, layer in enumerate(llama.layers):
        q, k, v = layer.wqkv.weight.split([layer.q_dim, layer.kv_dim, layer.kv_dim])
        gate, up = layer.w_gate_up.weight.split([layer.ffn_dim, layer.ffn_dim])
        p = f"model.layers.{i}."
        tensors.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                        p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": layer.wo.weight,
                        p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                        p + "mlp.down_proj.weight": layer.w_down.weight,
                        p + "input_layernorm.weight": layer.attn_norm,
                        p + "post_attention_layernorm.weight": layer.mlp_norm})
    save_file({k: v.contiguous().clone() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.ffn_dim, "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}))
    model.tokenizer.backend.save(str(tmp_path / "tokenizer.json"))

    ids = model.tokenizer.encode(PROMPTS[0])
    from_dir = wb.load_model(str(tmp_path))
    assert from_dir.tokenizer.encode(PROMPTS[0]) == ids
    torch.testing.assert_close(from_dir.logits(ids), model.logits(ids), atol=1e-5, rtol=0)
    from_path = wb.load_model(str(bundled_gguf_path()), dtype="fp32")
    torch.testing.assert_close(from_path.logits(ids), model.logits(ids), atol=0, rtol=0)


@pytest.mark.parametrize("preset", ["smollm2-135m", "tinyllama-1.1b"])  # tied and untied embeddings
@pytest.mark.parametrize("dtype", [f for f, fmt in WEIGHT_FORMATS.items() if not fmt.blocks])
def test_step_bytes_and_flops_written_out_by_hand(preset, dtype):
    """Every byte a step must read, from the config by hand, for every KV format: each layer's
    weights (fp32 norms), the embedding rows of the step's tokens, the final norm and the
    whole LM head (tied or not), and in decode the K and V of every cached token of every
    KV head, with the int8 format's fp32 scale per head per token. FLOPs: 2 per linear
    weight per token, 4 H D per visible (query, key) pair, 2 per LM-head weight per row."""
    m = wb.load_model(preset, random=True, layers=2, dtype=dtype)
    c = m.config
    w = {"fp32": 4, "bf16": 2, "int8": 1, "int8-g32": 1}[dtype]
    emb = {"fp32": 4, "bf16": 2, "int8": 2, "int8-g32": 2}[dtype]  # a random int8 model keeps a bf16 embedding
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    params = c.dim * q + 2 * c.dim * kv + q * c.dim + 3 * c.dim * c.ffn_dim

    def scales(rows, k):  # fp32 scales of an [rows, k] int8 matrix: one per row, or per 32 weights of a row
        return {"int8": 4 * rows, "int8-g32": 4 * rows * math.ceil(k / 32)}.get(dtype, 0)

    layer_scales = (scales(q + 2 * kv, c.dim) + scales(c.dim, q) + scales(2 * c.ffn_dim, c.dim)
                    + scales(c.dim, c.ffn_dim))  # qkv, o, gate/up, down
    layer = params * w + layer_scales + 2 * c.dim * 4
    head = c.vocab_size * c.dim * w + scales(c.vocab_size, c.dim) + c.dim * 4
    pair_flops, head_flops_per_row = 4 * c.n_heads * c.head_dim, 2 * c.vocab_size * c.dim

    def embedding_rows(tokens):
        return tokens * c.dim * emb

    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    D, Hkv = c.head_dim, c.n_kv_heads
    kivi = (4 * D / 32 + 4) / 2  # K: a scale per channel per 32 tokens; V: one per head per token
    block = 2 * math.ceil(D / 32)  # an fp16 scale per 32 values
    for name, elem, scale in (("int8:widen", 1, 4), ("int8:dot", 1, 4), ("int8:tile", 1, 4), ("fp16", 2, 0), ("bf16", 2, 0), ("fp32", 4, 0),
                              ("int8-tensor", 1, 0), ("int8-head", 1, 0), ("int8-token", 1, 4 / Hkv),
                              ("int8-ref", 1, 4), ("int8-kivi", 1, kivi), ("int8-block32", 1, block),
                              ("int4-head_token", 0.5, 4), ("int4-block32", 0.5, block), ("int4-kivi", 0.5, kivi)):
        fmt, kernel = parse_kv(name)
        out = m.generate(prompts, max_new_tokens=3, kv_cache=fmt, kv_kernel=kernel, stop_at_eos=False)
        prefill, decode = out.timings.prefill, out.timings.decode_steps
        assert prefill.bytes_read == 2 * layer + embedding_rows(8) + head  # attention reads fresh K, V
        assert prefill.total_flops == 2 * (2 * 8 * params + pair_flops * (15 + 6)) + 2 * head_flops_per_row
        for step, st in enumerate(decode):
            cached = (5 + step + 1) + (3 + step + 1)  # both sequences, the new token included
            kv_bytes = int(cached * 2 * c.n_kv_heads * (c.head_dim * elem + scale))
            assert st.bytes_read == 2 * (layer + kv_bytes) + embedding_rows(2) + head, (name, step)
            assert st.total_flops == 2 * (2 * 2 * params + pair_flops * cached) + 2 * head_flops_per_row
    assert set(KV_FORMATS) == {"int8", "fp16", "bf16", "fp32", "int8-tensor", "int8-head", "int8-token",
                               "int8-ref", "int8-kivi", "int8-block32", "int4-head_token", "int4-block32",
                               "int4-kivi"}  # a new format needs its row above


def test_bf16_weights_track_fp32(model):
    """bf16 weights (8 significant bits) change logits by far more than fp32 rounding but
    should keep the model's predictions: top-1 agreement >= 0.9 over a real text."""
    bf16 = wb.load_model("smollm2-135m", dtype="bf16")
    assert bf16.llama.layers[0].wqkv.weight.dtype == torch.bfloat16
    ids = model.tokenizer.encode(Path("/usr/share/common-licenses/Apache-2.0").read_text()[:1500])[:200]
    agree = (bf16.logits(ids).argmax(-1) == model.logits(ids).argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree
    out = bf16.generate("The capital of France is", max_new_tokens=4)
    assert "Paris" in out.text


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
])
def test_rope_scaling_matches_transformers(scaling):
    transformers = pytest.importorskip("transformers")
    from workbench.model.config import ModelConfig
    from workbench.model.llama import rope_tables

    cfg = ModelConfig("t", dim=256, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=512, vocab_size=300,
                      rope_theta=500000.0, rope_scaling=scaling, max_seq_len=64)
    hf_cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                                      intermediate_size=512, vocab_size=300, rope_theta=500000.0,
                                      rope_scaling=dict(scaling), max_position_embeddings=64)
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_cfg)
    x = torch.zeros(1, 64, 64)
    cos, sin = rotary(x, torch.arange(64)[None])
    ours_cos, ours_sin = rope_tables(cfg, 64)
    torch.testing.assert_close(ours_cos, cos[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_sin, sin[0], atol=1e-5, rtol=0)


def test_the_report_says_when_a_sequence_stopped_at_end_of_sequence(model):
    """Fewer tokens than asked for is said to be an end-of-sequence stop, not left to guess."""
    out = model.generate("The capital of France is", max_new_tokens=200)
    eos_stop = len(out.token_ids) < 200
    first = out.report().splitlines()[0]
    assert first.startswith(f"{len(out.token_ids)} tokens")
    assert ("stopped at end-of-sequence before the 200 asked for" in first) == eos_stop
    full = model.generate("The capital of France is", max_new_tokens=3, stop_at_eos=False)
    assert "stopped" not in full.report().splitlines()[0]


def test_one_definition_per_quantity_medians_over_steps():
    """Step ms, per-layer and per-part figures are medians over steps (a stray 500 ms step
    moves none of them); tokens/s is tokens over wall time; the fused step's thread wake-up
    is kept out of the layers (workbench.model.timing's definitions)."""
    from workbench.model.timing import PART_NAMES, StepRecord, Timings

    def step(ms, layer0_ms):
        parts = {p: [0.0, 0.0] for p in PART_NAMES}
        parts["attention"] = [layer0_ms / 1e3, 0.001]
        return StepRecord("decode", 1, parts, 0.0, [0, 0], [0, 0], 0, ms / 1e3)

    t = Timings(steps=[step(543.0, 6.0), step(20.0, 1.0), step(22.0, 1.0)], decode_s=0.585, decode_tokens=3)
    assert t.step_ms() == pytest.approx(22.0)
    assert t.per_layer()[0]["attention_ms"] == pytest.approx(1.0)  # not the mean (2.67): the first step's 6 ms
    assert t.per_part_ms()["attention"] == pytest.approx(2.0)
    assert t.decode_tokens_per_s == pytest.approx(3 / 0.585)
    assert "median of 3" in t.per_part_text() and t.summary()["decode_step_ms"] == pytest.approx(22.0)


def test_the_fused_step_books_the_thread_wake_up_apart(model):
    out = model.generate("Hello there", max_new_tokens=6, stop_at_eos=False, step="fused")
    for s in out.timings.decode_steps:
        layers = sum(sum(v) for v in s.parts_s.values())
        # the wake-up is outside the layers: in the step's non-layer time, not in any layer's parts
        assert s.wake_s > 0 and s.head_s >= s.wake_s and layers <= s.total_s - s.head_s + 1e-9
    ref = model.generate("Hello there", max_new_tokens=3, stop_at_eos=False, step="reference")
    assert all(s.wake_s > 0 and s.head_s >= s.wake_s for s in ref.timings.decode_steps)  # the same there


# GGUF's blocks by hand: (weights, bytes) of a block of each format these tests use.
BLOCKS = {"q4_0": (32, 18), "q5_0": (32, 22), "q8_0": (32, 34), "q4_k": (256, 144), "q6_k": (256, 210)}


@pytest.mark.parametrize("preset, dtype", [("smollm2-135m", "q4_k"), ("smollm2-135m", "q8_0"),
                                           ("tinyllama-1.1b", "q4_0")])
def test_step_bytes_of_block_formats_written_out_by_hand(preset, dtype):
    """Block formats: each matrix is rows x (K / block) blocks of its format's bytes, the
    format's fallback where K is not whole blocks (SmolLM2's 576-wide rows take q4_k's q5_0;
    its 1536-wide down rows stay q4_k); the embedding keeps the blocks too (a decode step
    reads one row per token), and a tied table is the LM head itself."""
    m = wb.load_model(preset, random=True, layers=2, dtype=dtype)
    c = m.config
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim

    def nbytes(rows, k):
        fmt = dtype if k % BLOCKS[dtype][0] == 0 else {"q4_k": "q5_0", "q6_k": "q8_0"}[dtype]
        return rows * k // BLOCKS[fmt][0] * BLOCKS[fmt][1]

    layer = (nbytes(q + 2 * kv, c.dim) + nbytes(c.dim, q) + nbytes(2 * c.ffn_dim, c.dim) + nbytes(c.dim, c.ffn_dim)
             + 2 * c.dim * 4)
    head = nbytes(c.vocab_size, c.dim) + c.dim * 4
    row = nbytes(1, c.dim)
    out = m.generate([[5, 6, 7, 8, 9], [10, 11, 12]], max_new_tokens=3, kv_cache="fp32", stop_at_eos=False)
    assert out.timings.prefill.bytes_read == 2 * layer + 8 * row + head
    for step, st in enumerate(out.timings.decode_steps):
        cached = (5 + step + 1) + (3 + step + 1)
        assert st.bytes_read == 2 * (layer + cached * 2 * c.n_kv_heads * c.head_dim * 4) + 2 * row + head
    extra = 0 if c.tied_embeddings else nbytes(c.vocab_size, c.dim)
    assert m.llama.weight_bytes == 2 * layer + head + extra


def test_the_text_stream_flushes_per_token_only_where_nothing_else_sends(model):
    """%generate's stream: a terminal or a pipe gets each token now (a flush per token); a
    Jupyter kernel's stream (ipykernel's OutStream, which sends on its own clock every
    flush_interval) is not flushed per token: there a flush blocked the generating thread
    until the kernel's IO thread had sent it, and gave the browser a message per token to
    draw (0.74x of ipython's tokens/s in JupyterLab, bench/notebooks.py --generate-speed)."""
    import io

    from workbench.runtime.streaming import TextStream

    class Counting(io.StringIO):
        flushes = 0

        def flush(self):
            self.flushes += 1

    class KernelStream(Counting):
        flush_interval = 0.2  # what ipykernel's OutStream has

    ids = model.tokenizer.encode(" Paris is the capital of France")
    for stream, per_token in ((Counting(), True), (KernelStream(), False)):
        on_token = TextStream(model.tokenizer, out=stream)
        for step, token in enumerate(ids):
            on_token(step, [token])
        assert stream.getvalue() == model.tokenizer.decode(ids)
        assert stream.flushes == (len(ids) if per_token else 0)
