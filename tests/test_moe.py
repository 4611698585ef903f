"""Mixture-of-experts families (workbench.model.arch: Mixtral, Qwen3-MoE): tiny random models
as transformers 5 saves them, loaded from their folders and held to transformers' fp32 logits on
a 140-token real text and its 16 greedy tokens; a routing that sends every token to one expert
still computes the model; the step records count the experts a step read; and the refusals:
a misshapen or missing expert tensor, dense layers among the sparse ones. GGUF files (stacked
experts), routing statistics and the cost model's bytes as the batch grows, serving, and two
ranks split by expert or by tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench.model.loaders import ModelLoadError, gguf_tokenizer
from workbench.model.quantize import use_more_bits
from gguf_edit import copy_gguf  # noqa: E402

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

TEXT = Path("/usr/share/common-licenses/Apache-2.0").read_text()[:3000]

# (transformers config class, its fields): 6 experts, 2 a token (Qwen3-MoE with and without
# renormalized weights: Qwen3-30B-A3B sets norm_topk_prob, transformers' default does not)
MOE = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=6, num_experts_per_tok=2, sliding_window=None)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=16,
                                         norm_topk_prob=True)),
    "qwen3_moe-plain": ("Qwen3MoeConfig", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=64,
                                               head_dim=16, norm_topk_prob=False)),
}


def save_tiny_moe(name: str, folder: Path, tokenizer, seed: int = 0, **overrides):
    class_name, extra = MOE[name]
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=tokenizer.vocab_size, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, initializer_range=0.2)
    cfg = getattr(transformers, class_name)(**{**common, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(1.0, 0.2)
    model.save_pretrained(folder)
    tokenizer.backend.save(str(Path(folder) / "tokenizer.json"))
    return model


@pytest.fixture(scope="module")
def tokenizer():
    return gguf_tokenizer()


@pytest.fixture(scope="module", params=list(MOE))
def moe(request, tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp(request.param)
    ref = save_tiny_moe(request.param, folder, tokenizer)
    ours = wb.load_model(str(folder), max_seq_len=256, max_batch=2)
    ids = ours.tokenizer.encode(TEXT)[:140]
    return request.param, ref, ours, ids, folder


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _ref_logits(ref, ids):
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].double()


def test_the_config_carries_the_experts(moe):
    name, ref, ours, _, _ = moe
    cfg, layer = ours.config, ours.llama.layers[0]
    assert cfg.arch == name.split("-")[0] and cfg.spec.moe
    assert (cfg.n_experts, cfg.experts_per_token) == (6, 2)
    assert cfg.norm_topk == (name != "qwen3_moe-plain")
    assert cfg.ffn_dim == (96 if name == "mixtral" else 64) == layer.ffn_dim
    assert len(layer.experts) == 6 and layer.router.out_features == 6
    assert set(ours.llama.weight_formats) >= {"router", "gate_up", "down"}
    assert ours.llama.weight_bytes == pytest.approx(cfg.weight_bytes(wb.model.weights.WEIGHT_FORMATS["fp32"]), rel=0.01)


@pytest.mark.parametrize("attention", ["slim", "flash"])
def test_prefill_logits_match_transformers(moe, attention):
    name, ref, ours, ids, _ = moe
    expected = _ref_logits(ref, ids)
    got = ours.logits(ids, attention=attention)
    assert _rel(got, expected) < 1e-4, name
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("step", ["fused", "reference"])
def test_greedy_tokens_match_transformers(moe, step):
    """16 greedy tokens, every decode step the fused C++ step (the router's top-k and the
    experts in C++) or the Python layers; each step's record counts the bytes of the experts
    it read (the shared part plus at most top_k experts at batch 1)."""
    name, ref, ours, ids, _ = moe
    expected = ref.generate(torch.tensor([ids[:60]]), max_new_tokens=16, do_sample=False)[0, 60:].tolist()
    out = ours.generate(ids[:60], max_new_tokens=16, stop_at_eos=False, step=step)
    assert out.token_ids == expected, (name, step)
    assert {s.path for s in out.timings.decode_steps} == {step}
    layer = ours.llama.layers[0]
    expert = layer.experts[0][0].nbytes + layer.experts[0][1].nbytes
    step = out.timings.decode_steps[-1]
    assert step.weight_bytes[0] == layer._shared_bytes + len(layer.last_experts) * expert
    assert 1 <= len(layer.last_experts) <= 2
    assert step.weight_bytes[0] < layer.weight_bytes


def test_a_batch_reads_the_experts_its_tokens_route_to(moe):
    """A prefill of 140 tokens routes to every expert here: its record counts each once (all of
    the layer's weights), where a decode step reads at most top_k of them."""
    _, _, ours, ids, _ = moe
    layer = ours.llama.layers[0]
    with torch.inference_mode():
        ours.logits(ids)
    assert layer.last_experts == list(range(6))
    out = ours.generate(ids, max_new_tokens=3, stop_at_eos=False)
    assert out.timings.prefill.weight_bytes[0] == layer.weight_bytes
    assert out.timings.decode_steps[-1].weight_bytes[0] < layer.weight_bytes


def test_batched_decode_matches_one_sequence_at_a_time(moe):
    """Two sequences decoded together through the fused step (an expert chosen by both runs
    once on both rows) give each one's own tokens."""
    name, _, ours, ids, _ = moe
    a, b = ids[:70], ids[10:41]
    together = ours.generate([a, b], max_new_tokens=8, stop_at_eos=False)
    assert {s.path for s in together.timings.decode_steps} == {"fused"}
    for prompt, got in zip((a, b), together.token_ids):
        assert got == ours.generate(prompt, max_new_tokens=8, stop_at_eos=False).token_ids, name


def test_every_token_routed_to_one_expert_still_computes_the_model(tokenizer, tmp_path):
    """A router whose row 0 dominates sends every token to expert 0 (and the tie among the
    rest to the same second expert in both): the outputs still match transformers'."""
    folder = tmp_path / "one"
    ref = save_tiny_moe("mixtral", folder, tokenizer)
    with torch.no_grad():
        for layer in ref.model.layers:
            gate = layer.mlp.gate.weight if hasattr(layer.mlp, "gate") else layer.block_sparse_moe.gate.weight
            gate[1:] = 0.0
            gate[0] *= 50.0
    ref.save_pretrained(folder)
    ours = wb.load_model(str(folder), max_seq_len=256)
    ids = ours.tokenizer.encode(TEXT)[:60]
    assert _rel(ours.logits(ids), _ref_logits(ref, ids)) < 1e-4
    assert 0 in ours.llama.layers[0].last_experts


def _edit(folder: Path, tmp_path: Path, change) -> Path:
    out = tmp_path / "edited"
    shutil.copytree(folder, out)
    tensors = load_file(str(out / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_a_misshapen_or_missing_expert_or_router_is_refused_by_name(moe, tmp_path):
    name, _, _, _, folder = moe
    key = next(k for k in load_file(str(folder / "model.safetensors")) if "layers.1." in k and "experts.3." in k)
    bad = _edit(folder, tmp_path / "shape", lambda t: t.__setitem__(key, t[key][:, :-1].contiguous()))
    with pytest.raises(ModelLoadError, match=key.replace(".", r"\.") + " has shape"):
        wb.load_model(str(bad))
    router = next(k for k in load_file(str(folder / "model.safetensors")) if "layers.2." in k and k.endswith("gate.weight")
                  and "experts" not in k)
    gone = _edit(folder, tmp_path / "gone", lambda t: t.pop(router))
    with pytest.raises(ModelLoadError, match=router.replace(".", r"\.") + " is missing"):
        wb.load_model(str(gone))


def test_dense_layers_among_the_experts_and_shared_experts_are_refused(tokenizer, tmp_path):
    folder = tmp_path / "q"
    save_tiny_moe("qwen3_moe", folder, tokenizer)
    for change, message in (({"mlp_only_layers": [1]}, "dense layers among the experts"),
                            ({"decoder_sparse_step": 2}, "decoder_sparse_step = 2"),
                            ({"num_experts_per_tok": 9}, "experts_per_token must be in 1..n_experts")):
        edited = tmp_path / f"e{len(message)}"
        shutil.copytree(folder, edited)
        cfg = json.loads((edited / "config.json").read_text())
        (edited / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ModelLoadError, match=message):
            wb.load_model(str(edited))


@pytest.mark.parametrize("dtype", ["bf16", "int8-g32", "q8_0"])
def test_the_experts_in_other_formats_stay_close(moe, dtype):
    """Each expert converted to the format (the router stays fp32): the same argmax over most
    of the text, and greedy decoding runs. A tiny random model's router sits near ties, where a
    weight's rounding flips a token's second expert and so its output: measured 0.66 (Mixtral,
    q8_0) to 0.89 (Qwen3-MoE, bf16), where the dense tiny families agree at 0.93-0.97."""
    name, ref, _, ids, folder = moe
    ours = wb.load_model(str(folder), dtype=dtype, max_seq_len=256)
    assert ours.llama.layers[0].router.formats[0].name == "fp32"
    got, expected = ours.logits(ids), _ref_logits(ref, ids)
    agree = (got.argmax(-1) == expected.argmax(-1)).double().mean().item()
    assert agree > 0.55, (name, dtype, agree)
    assert len(ours.generate(ids[:20], max_new_tokens=4, stop_at_eos=False).token_ids) == 4


# -- GGUF files: the experts stacked in one 3-D tensor per kind (ffn_gate_exps [experts, ffn,
# dim]), the router ffn_gate_inp; Mixtral as general.architecture "llama" with an expert_count,
# Qwen3-MoE as "qwen3moe" (llama.cpp's converter's names and layout).

def hf_to_gguf(folder: Path, out: Path, cfg) -> Path:
    """A tiny Hugging Face MoE folder written as the F32 GGUF llama.cpp's converter makes of it:
    each kind of the experts' matrices stacked, Llama-family q / k rows in llama.cpp's RoPE order."""
    from workbench.analysis.gguf_files import write_gguf
    from workbench.model.arch import gguf_layer_tensors

    spec, sd = cfg.spec, load_file(str(folder / "model.safetensors"))

    def llama_cpp_rows(w: torch.Tensor, heads: int) -> torch.Tensor:  # rotate-half -> interleaved
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
               "output.weight": sd["lm_head.weight"]}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        for ours in gguf_layer_tensors(spec, cfg):
            if ours.startswith("experts."):
                kind = ours.split(".")[1]
                t = torch.stack([sd[p + spec.hf_name(f"experts.{e}.{kind}")] for e in range(cfg.n_experts)])
            else:
                t = sd[p + spec.hf_name(ours)]
            if spec.gguf_rope_rows and ours in ("wq", "wk"):
                t = llama_cpp_rows(t, cfg.n_heads if ours == "wq" else cfg.n_kv_heads)
            tensors[f"blk.{i}.{spec.gguf_name(ours)}"] = t
    arrays = {k: v.float().contiguous().numpy() for k, v in tensors.items()}
    write_gguf(out, cfg, cfg.vocab_size, {k: (a.shape, a.dtype, lambda a=a: a) for k, a in arrays.items()}, "tiny")
    return out


def test_a_gguf_file_of_each_family_is_the_same_model(moe, tmp_path):
    """The folder written as a GGUF file (Mixtral as llama with experts, Qwen3-MoE as qwen3moe)
    loads as the same family with the same experts: the same logits as from its folder, the
    same 16 greedy tokens as transformers through the fused step."""
    name, ref, ours, ids, folder = moe
    if name == "qwen3_moe-plain":
        pytest.skip("a GGUF file has no norm_topk_prob: llama.cpp renormalizes in both families")
    path = hf_to_gguf(folder, tmp_path / f"{name}.gguf", ours.config)
    model = wb.load_model(str(path), max_seq_len=256)
    cfg = model.config
    assert (cfg.arch, cfg.n_experts, cfg.experts_per_token, cfg.norm_topk, cfg.ffn_dim) == (
        name, 6, 2, True, ours.config.ffn_dim)
    assert model.llama.weight_formats["gate_up"] == {"fp32": 6 * 3}
    assert _rel(model.logits(ids), ours.logits(ids)) < 1e-5
    expected = ref.generate(torch.tensor([ids[:60]]), max_new_tokens=16, do_sample=False)[0, 60:].tolist()
    out = model.generate(ids[:60], max_new_tokens=16, stop_at_eos=False)
    assert out.token_ids == expected and {s.path for s in out.timings.decode_steps} == {"fused"}


@pytest.fixture(scope="module")
def moe_q4_k_m(tmp_path_factory, tokenizer):
    """A Qwen3-MoE with rows of whole K-quant super-blocks (hidden and expert FFN 256), as a
    GGUF file requantized by our quantizer into llama.cpp's Q4_K_M mix."""
    from workbench.model.quantize import write_quantized

    folder = tmp_path_factory.mktemp("q3moe256")
    save_tiny_moe("qwen3_moe", folder, tokenizer, hidden_size=256, moe_intermediate_size=256, head_dim=64)
    cfg = wb.load_model(str(folder), max_seq_len=256).config
    f32 = hf_to_gguf(folder, folder / "f32.gguf", cfg)
    return write_quantized(f32, folder / "q4_k_m.gguf", "Q4_K_M")


def test_a_q4_k_m_moe_file_runs_its_experts_in_their_own_blocks(moe_q4_k_m):
    """Each expert's matrices as the file's Q4_K / Q6_K blocks (down Q6_K in the layers
    llama.cpp gives more bits), the router F32 as llama.cpp keeps it: teacher-forced on real
    text, the logits of the blocks as they are against the same file dequantized to fp32 agree
    as the dense files' do, and the fused step and the Python layers give the same tokens."""
    from workbench.analysis.forcing import forced_logits
    from workbench.model.gguf_file import read_gguf
    from workbench.model.switches import Switches

    kinds = {n: t.tensor_type.name for n, t in read_gguf(moe_q4_k_m).tensors.items()}
    assert kinds["blk.1.ffn_gate_exps.weight"] == kinds["blk.1.ffn_up_exps.weight"] == "Q4_K"
    more = [i for i in range(3) if use_more_bits(i, 3)]
    assert {kinds[f"blk.{i}.ffn_down_exps.weight"] for i in more} == {"Q6_K"}
    assert kinds["blk.0.ffn_gate_inp.weight"] == "F32"
    blocks, exact = wb.load_model(str(moe_q4_k_m)), wb.load_model(str(moe_q4_k_m), dtype="fp32")
    formats = blocks.llama.weight_formats
    assert formats["gate_up"] == {"q4_k": 3 * 6} and formats["router"] == {"fp32": 3}
    assert formats["down"] == {"q6_k": 6 * sum(use_more_bits(i, 3) for i in range(3)),
                               "q4_k": 6 * sum(not use_more_bits(i, 3) for i in range(3))}
    ids = blocks.tokenizer.encode(TEXT)[:80]
    follow = torch.tensor([ids[1:]])
    la, lb = (forced_logits(m.llama, [ids[:1]], follow, Switches("slim", "fp32"))[0] for m in (blocks, exact))
    agree = (la.argmax(-1) == lb.argmax(-1)).double().mean().item()
    assert _rel(la, lb) < 5e-3 and agree >= 0.95, (_rel(la, lb), agree)  # measured 8e-4, every argmax equal
    fused = blocks.generate(ids[:40], max_new_tokens=12, stop_at_eos=False)
    assert fused.token_ids == blocks.generate(ids[:40], max_new_tokens=12, stop_at_eos=False, step="reference").token_ids


def test_a_misshapen_or_missing_gguf_expert_tensor_is_refused_by_name(moe_q4_k_m, tmp_path):
    cut = copy_gguf(moe_q4_k_m, tmp_path / "cut.gguf",
                    lambda n, a, kind: (a[:5] if n == "blk.2.ffn_up_exps.weight" else a, kind))
    with pytest.raises(ModelLoadError, match=r"blk\.2\.ffn_up_exps\.weight has shape \(5, 256, 256\), "
                                             r"expected \(6, 256, 256\)"):
        wb.load_model(str(cut))
    gone = copy_gguf(moe_q4_k_m, tmp_path / "gone.gguf",
                     lambda n, a, kind: None if n == "blk.1.ffn_gate_inp.weight" else (a, kind))
    with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_gate_inp\.weight is missing"):
        wb.load_model(str(gone))


def test_a_moe_family_the_workbench_does_not_run_is_named(tmp_path):
    import gguf

    path = tmp_path / "q2moe.gguf"
    w = gguf.GGUFWriter(path, "qwen2moe")
    w.add_block_count(1)
    w.add_expert_count(60)
    w.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported architecture 'qwen2moe' with 60 experts"):
        wb.load_model(str(path))


# -- routing statistics and the cost model's bytes as the batch grows (workbench.analysis.experts)

def test_expert_routing_counts_where_each_layer_sends_real_text(moe):
    from workbench.analysis.experts import ExpertRouting

    name, _, ours, _, _ = moe
    routing = wb.expert_routing(ours, text=TEXT, tokens=120)
    assert routing.load.shape == (3, 6) and routing.tokens == 120 and routing.top_k == 2
    assert routing.load.sum(-1).tolist() == [240] * 3  # every token's two experts, in every layer
    assert all(0 < h <= 2.585 for h in routing.entropy())  # log2(6) when even
    assert all(1 / 6 <= b <= 0.5 for b in routing.busiest())  # no expert takes more than all tokens' one slot
    assert routing.expected_experts(1) == pytest.approx([2.0] * 3)  # q_e sum to top_k
    many = routing.expected_experts(64)
    assert all(4 < n <= 6 for n in many) and routing.expected_experts(4) < many
    assert all(0.5 <= s <= 1 for s in routing.busiest_rank(2))
    assert "entropy_bits" in repr(routing)
    uniform = ExpertRouting.uniform(ours.config)
    assert uniform.expected_experts(1) == pytest.approx([2.0] * 3)
    assert uniform.entropy() == pytest.approx([2.585] * 3, abs=1e-3)
    with pytest.raises(ValueError, match="batch must be an integer >= 1"):
        routing.expected_experts(0)
    with pytest.raises(ValueError, match="ranks must be an integer in 1..6"):
        routing.busiest_rank(7)


def test_the_layers_count_their_load_in_every_step(moe):
    """Layer.expert_load counts every token of every prefill and decode step, fused or not:
    the same counts either way for the same tokens."""
    from workbench.analysis.experts import ExpertRouting

    _, _, ours, ids, _ = moe
    counts = {}
    for step in ("fused", "reference"):
        before = ExpertRouting.of_model(ours).load
        ours.generate(ids[:30], max_new_tokens=9, stop_at_eos=False, step=step)
        counts[step] = ExpertRouting.of_model(ours).load - before
    assert counts["fused"].sum(-1).tolist() == [(30 + 8) * 2] * 3  # the prompt, then 8 decode steps' tokens
    assert torch.equal(counts["fused"], counts["reference"])


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_the_cost_models_bytes_follow_the_routing_as_the_batch_grows(moe, batch):
    """The cost model's decode step, with the distinct experts expected under the routing
    measured on real text, against the step records of B real-text prompts decoded together:
    the experts a layer's step read (from the records' bytes: a tiny model's experts are a
    small part of its step, so they are held to the 10% on their own) and the step's bytes.
    B = 1 reads exactly top_k experts."""
    from workbench.analysis.text import sample_prompts

    name, _, ours, _, _ = moe
    layers = ours.llama.layers
    expert = layers[0].experts[0][0].nbytes + layers[0].experts[0][1].nbytes
    routing = wb.expert_routing(ours, tokens=400)
    out = ours.generate(sample_prompts(ours.tokenizer, 20, batch), max_new_tokens=12, stop_at_eos=False)
    steps = out.timings.decode_steps[1:]
    read = [(w - layer._shared_bytes) / expert for s in steps for w, layer in zip(s.weight_bytes, layers)]
    measured = sum(sum(s.weight_bytes) + sum(s.kv_bytes) + s.head_bytes for s in steps) / len(steps)
    p = wb.predict(ours, batch=batch, prompt_len=20, new_tokens=12, kv_cache=ours.kv_cache, routing=routing)
    assert abs(p.experts["decode"] / (sum(read) / len(read)) - 1) < 0.10, (name, batch, p.experts, sum(read) / len(read))
    assert abs(p.step_bytes("decode") / measured - 1) < 0.02
    expected = routing.expected_experts(batch)
    assert p.experts["decode"] == pytest.approx(sum(expected) / len(expected))  # the layers' mean
    assert "experts read a layer's step" in repr(p) and "tokens of the license texts" in p.routing
    if batch == 1:
        assert p.experts["decode"] == pytest.approx(2.0) and set(read) == {2.0}


def test_predicting_a_mixture_from_its_preset(moe):
    p = wb.predict("qwen3-30b-a3b", batch=1)
    assert p.experts["decode"] == pytest.approx(8.0) and p.routing == "uniform (assumed)"
    assert p.experts["prefill"] == pytest.approx(128 * (1 - (1 - 8 / 128) ** 64))
    many = wb.predict("qwen3-30b-a3b", batch=64)
    assert many.experts["decode"] > 100 and many.step_bytes("decode") > 5 * p.step_bytes("decode")
    with pytest.raises(ValueError, match="routing: smollm2-135m is not a mixture of experts"):
        wb.predict("smollm2-135m", routing=wb.expert_routing(moe[2], text=TEXT, tokens=10))
    with pytest.raises(ValueError, match="not a mixture of experts"):
        wb.expert_routing(wb.load_model("smollm2-135m"))


def test_the_continuous_batching_server_runs_a_mixture(moe):
    """Requests arriving while others decode (chunked prefill, slots reused), with prompt-prefix
    reuse: each gets the greedy tokens of generating it alone, the steps on the fused step."""
    import random

    from test_serving import arrive_and_run
    from workbench.analysis.text import sample_prompts
    from workbench.serving import Scheduler

    name, _, ours, _, _ = moe
    rng = random.Random(2)
    shared = sample_prompts(ours.tokenizer, 40, 1)[0]
    requests = [(shared[:rng.randint(20, 40)] + [400 + i], rng.randint(1, 8)) for i in range(10)]
    s = Scheduler(ours, slots=3, max_len=64, chunk=16, kv_cache="fp32", prefix_cache_tokens=256, block=8)
    handles = arrive_and_run(s, requests, seed=2)
    for (prompt, n), r in zip(requests, handles):
        assert r.output == ours.generate([prompt], max_new_tokens=n, stop_at_eos=False).token_ids[0], name
    assert s.stats["decode_paths"] == {"fused"} and any(r.reused for r in handles)


# -- two ranks: expert parallel (whole experts per rank) and tensor parallel (each expert's FFN split)

@pytest.fixture(scope="module")
def clusters():
    """The module's 2-rank cluster, started when first asked for (and again after the ablation
    test, whose own clusters need it stopped); stopped at the end."""
    held = []
    yield held
    for c in held:
        c.stop()


@pytest.fixture
def cluster(clusters):
    import os

    pytest.importorskip("ipyparallel")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs for 2 ranks")
    from workbench.distributed.cluster import Cluster, running

    if running() is None:
        clusters.append(Cluster(2, backend="shm", pin=True, timeout_s=60).start())
    return running()


@pytest.mark.parametrize("split", ["expert", "tensor"])
def test_two_ranks_give_one_process_tokens(cluster, moe, split):
    """Expert parallel: each rank holds 3 of the 6 experts whole and runs the tokens routed to
    them; tensor parallel: each holds half of every expert's FFN. Both end in the MLP's
    all-reduce and give one process's greedy tokens, one sequence and two, on the fused step
    and the Python path."""
    from workbench.distributed.tp import TPOptions

    name, _, ours, ids, folder = moe
    model = cluster.load_model(str(folder), max_seq_len=256, max_batch=2, options=TPOptions(experts=split))
    shards = model.shards
    if split == "expert":
        assert [tuple(s["experts"]) for s in shards] == [(0, 3), (3, 6)]
    else:
        assert [tuple(s["experts"]) for s in shards] == [(0, 6), (0, 6)] and shards[0]["ffn"] != shards[1]["ffn"]
    assert sum(s["weight_bytes"] for s in shards) < 2 * ours.llama.weight_bytes
    prompt = ids[:40]
    for step in ("fused", "reference"):
        got = model.generate(prompt, max_new_tokens=12, stop_at_eos=False, step=step)
        assert got.token_ids == ours.generate(prompt, max_new_tokens=12, stop_at_eos=False).token_ids, (name, split, step)
    two = model.generate([prompt, ids[50:61]], max_new_tokens=6, stop_at_eos=False)
    assert two.token_ids == ours.generate([prompt, ids[50:61]], max_new_tokens=6, stop_at_eos=False).token_ids
    assert all(s.path == "fused" for s in two.timings.decode_steps)
    with pytest.raises(ValueError, match="fixed at load"):
        model.set_options(experts="tensor" if split == "expert" else "expert")


def test_the_tensor_parallel_ablation_measures_both_splits(moe):
    """tp_ablation (what %ablate --ranks ... --experts runs) loads the cluster once per split and
    reports each rank's load: the busiest rank's share of the routed tokens under expert
    parallel (its experts' share in the single process's run), 1 / 2 under the tensor split;
    the same tokens as one process in both, and the cost model's ratio for each."""
    from workbench.analysis.tp_ablation import tp_ablation

    from workbench.distributed.cluster import running

    name, _, _, _, folder = moe
    if name != "qwen3_moe":
        pytest.skip("one family is enough for the ablation's plumbing")
    if running() is not None:  # the ablation starts its own clusters: the 2-rank tests' one goes first
        running().stop()
    rows = tp_ablation(str(folder), {"max_seq_len": 256}, ranks=(1, 2), backends=("shm",), experts=("expert", "tensor"),
                       token_broadcast=("ids",), lm_head=("topk",), zero_copy=(True,), prompt_len=16, new_tokens=4,
                       repeats=1)
    assert [(r["ranks"], r["experts"]) for r in rows] == [(1, "-"), (2, "expert"), (2, "tensor")]
    assert all(r["same_tokens_as_tp1"] and r["path"] == "fused" for r in rows)
    expert, tensor = rows[1], rows[2]
    assert 0.5 <= expert["busiest_rank_share"] <= 1 and tensor["busiest_rank_share"] == 0.5
    assert expert["roofline_vs_tp1"] is not None and tensor["roofline_vs_tp1"] is not None
    assert expert["comm_bytes_per_token"] > 0 and tensor["comm_bytes_per_token"] > 0
    with pytest.raises(ValueError, match="experts must be some of expert, tensor"):
        tp_ablation(str(folder), {"max_seq_len": 256}, ranks=(2,), backends=("shm",), experts=("rows",))


def test_the_cost_model_splits_a_mixture_by_expert_or_by_tensor():
    """Uniform routing of Qwen3-30B-A3B at batch 1: expert parallel's busiest rank reads half
    of the 8 experts a token chooses, whole; the tensor split reads all 8, half of each."""
    one = wb.predict("qwen3-30b-a3b", batch=1)
    ep = wb.predict("qwen3-30b-a3b", batch=1, ranks=2, comm=(10.0, 5.0), expert_split="expert")
    tp = wb.predict("qwen3-30b-a3b", batch=1, ranks=2, comm=(10.0, 5.0), expert_split="tensor")
    assert ep.experts["decode"] == pytest.approx(4.0) and tp.experts["decode"] == pytest.approx(8.0)
    expert_mb = (one.layers["decode"]["mlp"].bytes - 4 * 128 * 2048) / 8
    for p in (ep, tp):
        assert p.layers["decode"]["mlp"].bytes - 4 * 128 * 2048 == pytest.approx(4 * expert_mb, rel=0.01)
    with pytest.raises(ValueError, match="expert_split must be 'expert' or 'tensor'"):
        wb.predict("qwen3-30b-a3b", ranks=2, comm=(10.0, 5.0), expert_split="rows")


def test_a_runs_expert_load_is_in_its_records_the_live_figures_and_the_report(moe, tmp_path):
    """Every step record carries the tokens it routed to each expert of each layer; a run's
    Timings sums them; LivePlots shows the heat map (only for a mixture); the report's
    generation entry keeps the table and draws it; a step's FLOPs count each token's own
    experts (2 per weight of the shared part and of the experts it was routed to)."""
    from workbench import report
    from workbench.ui.plots import LivePlots

    name, _, ours, ids, _ = moe
    out = ours.generate([ids[:30], ids[40:52]], max_new_tokens=5, stop_at_eos=False)
    load = out.timings.expert_load()
    assert len(load) == 3 and all(len(row) == 6 for row in load)
    assert [sum(row) for row in load] == [(30 + 12 + 2 * 4) * 2] * 3  # both prompts, then 4 decode steps of 2 tokens
    step = out.timings.decode_steps[-1]
    assert {s.tokens for s in out.timings.decode_steps} == {2}
    layer = ours.llama.layers[0]
    expert_params = [g.params + d.params for g, d in layer.experts]
    routed = sum(n * p for n, p in zip(step.expert_tokens[0], expert_params))
    attention = step.flops[0] - 2 * (2 * layer._shared_params + routed)
    assert 0 < attention < 4 * ours.config.n_heads * ours.config.head_dim * 2 * 60  # Q K^T and P V over at most 60 keys
    plots = LivePlots(widget=True, peak_gbps=40.0)
    box = plots.box()
    assert plots.experts_output not in box.children  # until a run has an expert load
    plots.finish(out.timings, "moe", batch=2)
    assert plots.experts_output.layout.display is None and box.children[-1] is plots.experts_output
    fig = plots.experts_output.outputs[0]["data"]["application/vnd.plotly.v1+json"]
    assert fig["data"][0]["type"] == "heatmap" and fig["data"][0]["z"] == load
    assert "entropy" in fig["layout"]["title"]["text"] and "busiest of 2 ranks" in fig["layout"]["title"]["text"]
    report.clear()
    entry = report.record(out, ours, command="model.generate(...)")
    assert entry["expert_load"] == load
    page = report.write(tmp_path / "r.html")
    assert "fig-experts-" in (tmp_path / "r.html").read_text()
    report.clear()
    dense = LivePlots(widget=True, peak_gbps=40.0)
    box = dense.box()
    dense.finish(wb.load_model("smollm2-135m", random=True, layers=1).generate("hi", max_new_tokens=2).timings, "d")
    assert dense.experts_output.layout.display == "none" and dense.experts_output not in box.children


def test_the_batch_figure_sets_prediction_beside_measurement():
    """bench/moe_batch.py's figure from its rows: the measured bytes with their spread, both
    predictions, and the experts read, on a log batch axis."""
    import plotly.graph_objects as go

    from workbench.ui.plots import moe_bytes_spec

    rows = [{"batch": b, "measured_bytes": [m * 0.99e6, m * 1e6, m * 1.02e6], "predicted_bytes": m * 1.01e6,
             "uniform_bytes": m * 1.2e6, "measured_experts": [e, e], "predicted_experts": e + 0.5,
             "uniform_experts": e + 2} for b, m, e in ((1, 222, 8), (4, 444, 27), (16, 861, 63), (64, 1427, 110))]
    spec = moe_bytes_spec(rows)
    measured = spec["data"][0]
    assert measured["y"] == [222, 444, 861, 1427] and measured["error_y"]["array"][0] == pytest.approx(222 * 0.02)
    assert [t["name"] for t in spec["data"][1:3]] == ["predicted, measured routing", "predicted, uniform routing"]
    assert spec["data"][3]["y"] == [8, 27, 63, 110] and spec["layout"]["xaxis"]["type"] == "log"
    go.Figure(spec)  # valid plotly


def test_the_magics_load_a_mixture_on_a_cluster_split_either_way(moe, magic):
    """In a real IPython shell: %load_model --experts on a cluster (refused without one, by
    name), %generate on the ranks records the run's expert load, the Reproduce commands carry
    the split, and other switches leave it as loaded."""
    import os

    from IPython.core.error import UsageError

    from workbench.distributed.cluster import running

    name, _, ours, ids, folder = moe
    if name != "mixtral" or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one family is enough for the magics; 2 ranks need 2 CPUs")
    pytest.importorskip("ipyparallel")
    if running() is not None:  # the 2-rank tests' cluster: the magic starts its own
        running().stop()
    _, err = magic(f"%load_model {folder} --experts tensor")
    assert isinstance(err, UsageError) and "%distributed start first" in str(err)
    out, err = magic("%distributed start -n 2 --backend shm --pin")
    assert err is None, err
    try:
        out, err = magic(f"%load_model {folder} --experts tensor")
        assert err is None, err
        model = magic.shell.user_ns["wb_model"]
        assert [tuple(s["experts"]) for s in model.shards] == [(0, 6), (0, 6)] and model.options.experts == "tensor"
        out, err = magic("%generate -n 6 Licensed under the Apache License, Version 2.0")
        assert err is None, err
        from workbench import report

        entry = report.recorded()[-1]
        assert entry["workload"]["tensor_parallel"]["experts"] == "tensor" and entry["expert_load"]
        assert "--experts tensor" in entry["command"]
        _, err = magic("%distributed --lm-head gather")
        assert err is None
        assert model.options.experts == "tensor"
    finally:
        magic("%distributed stop")
    assert running() is None
