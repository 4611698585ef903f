"""The continuous-batching scheduler (workbench.serving) on the bundled model, fp32 weights
and cache: requests arriving while others decode (chunked prefill, slots reused as requests
leave) each get the greedy tokens of generating them alone; the same with prompt-prefix
reuse, which must hit; the batched steps run on the fused step; bad requests are clear."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

import workbench as wb
from workbench.analysis.text import sample_prompts
from workbench.serving import QueueFull, Scheduler


@pytest.fixture(scope="module")
def model():
    return wb.load_model("smollm2-135m")


@pytest.fixture(scope="module")
def random_model():
    return wb.load_model("smollm2-135m", random=True, layers=2, seed=5)


def alone(model, prompt, n):
    return model.generate([prompt], max_new_tokens=n, stop_at_eos=False).token_ids[0]


def arrive_and_run(s, requests, seed=0):
    """Submit the requests a few at a time while the scheduler steps (arrivals during
    decoding), then run until all are done."""
    rng = random.Random(seed)
    pending = list(requests)
    handles = []
    while pending or s.busy:
        for _ in range(rng.randint(0, 3)):
            if pending:
                prompt, n = pending.pop(0)
                handles.append(s.submit(prompt, n, stop_at_eos=False))
        s.step()
    return handles


def test_requests_arriving_while_others_decode_get_their_own_greedy_tokens(model):
    rng = random.Random(1)
    texts = sample_prompts(model.tokenizer, 80, 32)
    requests = [(p[:rng.randint(3, 80)], rng.randint(1, 12)) for p in texts]  # 32 mixed lengths
    s = Scheduler(model, slots=5, max_len=128, chunk=24, kv_cache="fp32")
    handles = arrive_and_run(s, requests)
    for (prompt, n), r in zip(requests, handles):
        assert r.done and r.finish_reason == "length" and len(r.output) == n
        assert r.output == alone(model, prompt, n), (len(prompt), n)
        assert r.first_token_s == r.token_times[0] and len(r.token_times) == n
    assert s.stats["decode_paths"] == {"fused"} and s.stats["prefilled_tokens"] == sum(len(p) for p, _ in requests)
    assert not s.running and not s.waiting


@settings(max_examples=12)
@given(pieces=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9)), min_size=1, max_size=4),
       kv=st.sampled_from(["fp32", "fp16", "int8"]))
def test_one_extend_over_several_rows_equals_each_row_alone(random_model, pieces, kv):
    """LlamaModel.extend continues several rows in one pass (one product per weight over all
    their tokens): each piece's last logits and its row's K / V equal extending that row
    alone, for ragged starts (a row already holding 0..20 tokens) and lengths, GQA 3:1."""
    llama, gen = random_model.llama, torch.Generator().manual_seed(len(pieces))
    rows = list(range(len(pieces)))[::-1]  # rows in any order
    seqs = [torch.randint(3, 1000, (start + n,), generator=gen) for start, n in pieces]
    together, alone_ = (llama.new_cache(len(pieces), 32, kv) for _ in range(2))
    for cache in (together, alone_):
        for row, seq, (start, _) in zip(rows, seqs, pieces):
            if start:
                llama.extend(seq[:start], [start], [row], [0], cache)
    tokens = torch.cat([seq[start:] for seq, (start, _) in zip(seqs, pieces)])
    logits, _ = llama.extend(tokens, [n for _, n in pieces], rows, [start for start, _ in pieces], together)
    for b, (row, seq, (start, n)) in enumerate(zip(rows, seqs, pieces)):
        ref, _ = llama.extend(seq[start:], [n], [row], [start], alone_)
        # Not bit-equal: at different row counts the products take different kernels (matrix-
        # vector below the crossover, GEMM above) with other fp32 summation orders, and an int8
        # cache quantizes keys that differ in their last bits (measured up to 1.4e-4 of the
        # largest logit over 2 layers); a wrong row, start or position is off by order 1.
        torch.testing.assert_close(logits[b], ref[0], atol=1e-3 * ref.abs().max().item(), rtol=0)
        # The cache's own values: an int8 code may land one step over (hypothesis found a key
        # at a half-step boundary, 1 of 2304 codes); the float formats within rounding.
        atol, rtol = (1.0, 0.0) if kv == "int8" else (1e-4, 1e-3)
        for layer in range(len(llama.layers)):
            for a, r in ((together.k, alone_.k), (together.v, alone_.v)):
                torch.testing.assert_close(a[layer][row, :, :start + n].float(), r[layer][row, :, :start + n].float(),
                                           atol=atol, rtol=rtol)


def test_extend_names_what_does_not_fit(random_model):
    llama = random_model.llama
    cache = llama.new_cache(2, 16, "fp32")
    with pytest.raises(ValueError, match="rows must be distinct rows of the cache"):
        llama.extend(torch.tensor([5, 6]), [1, 1], [0, 0], [0, 0], cache)
    with pytest.raises(ValueError, match="rows must be distinct rows of the cache \\(0..1\\), got \\[2\\]"):
        llama.extend(torch.tensor([5]), [1], [2], [0], cache)
    with pytest.raises(ValueError, match="10 tokens at position 10 do not fit a cache of 16"):
        llama.extend(torch.arange(10), [10], [0], [10], cache)
    with pytest.raises(ValueError, match="equally long"):
        llama.extend(torch.tensor([5]), [1], [0, 1], [0], cache)
    with pytest.raises(ValueError, match="3 tokens given for pieces of 2"):
        llama.extend(torch.tensor([5, 6, 7]), [2], [0], [0], cache)


def test_a_first_token_is_handed_out_before_the_steps_decode(model):
    """on_token sees each token the moment it is picked: a prompt's first token before the
    decode step of the same scheduler step (a server streams it from there), then one per
    decode step."""
    s = Scheduler(model, slots=2, max_len=64, kv_cache="fp32")
    seen = []
    s.on_token = lambda r: seen.append((r.id, len(r.output), s.stats["decode_steps"]))
    a = s.submit(list(range(100, 110)), 3, stop_at_eos=False)
    s.step()
    assert seen == [(a.id, 1, 0), (a.id, 2, 1)]  # the prefill's token, then the step's decode
    s.run()
    assert seen[2:] == [(a.id, 3, 2)] and a.done


def test_a_server_prefills_a_burst_of_requests_in_its_first_step(model):
    """The server's engine, woken from idle, admits what arrives within gather_s of the last
    arrival to the same first step: three requests sent 20 ms apart all get their first token
    from one prefill, none waits behind another's step."""
    import asyncio
    import threading

    from workbench.serving.server import Engine

    s = Scheduler(model, slots=4, max_len=64, kv_cache="fp32")
    engine = Engine(s, gather_s=0.2)
    firsts, stream = [], engine.scheduler.on_token

    def on_token(r):
        if len(r.output) == 1:
            firsts.append(s.stats["decode_steps"])
        stream(r)

    s.on_token = on_token
    worker = threading.Thread(target=engine.run)
    worker.start()

    async def burst():
        queues = []
        for i in range(3):
            queues.append(engine.submit(list(range(100 + i, 110 + i)), 2, stop_at_eos=False)[1])
            await asyncio.sleep(0.02)
        for q in queues:
            while not (await q.get())[1]:
                pass

    try:
        asyncio.run(burst())
    finally:
        engine.stop()
        worker.join()
    assert firsts == [0, 0, 0]  # every first token before the first decode step


def test_a_burst_goes_on_while_requests_keep_its_spacing():
    """BurstGather (the engine's rule, on given times): a burst goes on while each request
    follows the last within twice the widest spacing seen (gap_s at least), at most
    most x gap_s; what it learnt from past bursts widens the wait for the next burst's
    second request, where a fixed gap most often cut one; a lone request waits gap_s."""
    from workbench.serving.server import BurstGather

    g = BurstGather(gap_s=0.003, most=10)
    assert g.deadline([5.0]) == pytest.approx(5.003)  # alone, nothing learnt: gap_s
    # 2.2 ms then 2.7 ms apart: the next may come up to 5.4 ms after the last
    assert g.deadline([5.0, 5.0022, 5.0049]) == pytest.approx(5.0049 + 0.0054)
    assert g.deadline([5.0, 5.001, 5.002]) == pytest.approx(5.005)  # tighter than gap_s: gap_s
    assert g.deadline([5.0, 5.012, 5.024]) == pytest.approx(5.030)  # never past most x gap_s
    g.ended([5.0])  # a lone request teaches nothing
    assert g.deadline([7.0]) == pytest.approx(7.003)
    for widest in (0.004, 0.005, 0.006):
        g.ended([1.0, 1.0 + widest, 1.0 + widest + 0.001])
    assert g.deadline([9.0]) == pytest.approx(9.010)  # twice the median widest, 5 ms
    assert g.deadline([9.0, 9.0001]) == pytest.approx(9.0101)
def test_each_step_prefills_up_to_chunk_tokens_oldest_first(model):
    """chunk is a token budget per step: short prompts that arrive together are prefilled
    together, a long one a chunk at a time, the oldest first, never more than chunk a step."""
    texts = sample_prompts(model.tokenizer, 40, 4)
    s = Scheduler(model, slots=4, max_len=96, chunk=32, kv_cache="fp32")
    short = [s.submit(p[:10], 3, stop_at_eos=False) for p in texts[:3]]
    long_ = s.submit(texts[3][:40], 2, stop_at_eos=False)
    s.step()  # 3 x 10 tokens, then 2 of the long prompt's
    assert [r.state for r in short] == ["decode"] * 3 and long_.filled == 2
    assert s.stats["prefilled_tokens"] == 32 and all(len(r.output) == 2 for r in short)  # prefill's token + a decode
    s.step()
    assert long_.filled == 34 and s.stats["prefilled_tokens"] == 64
    s.run()
    assert long_.output == alone(model, texts[3][:40], 2)
    assert all(r.output == alone(model, p[:10], 3) for r, p in zip(short, texts))


def test_prefix_reuse_hits_and_changes_no_token(model):
    shared = sample_prompts(model.tokenizer, 70, 1)[0]
    suffixes = sample_prompts(model.tokenizer, 12, 20)[10:]
    requests = [(shared + sfx[:3 + i], 6) for i, sfx in enumerate(suffixes)]
    s = Scheduler(model, slots=3, max_len=128, chunk=32, kv_cache="fp32", prefix_cache_tokens=256, block=16)
    handles = arrive_and_run(s, requests, seed=2)
    for (prompt, n), r in zip(requests, handles):
        assert r.output == alone(model, prompt, n)
    later = [r for r in handles if r.reused]
    # the 4 whole blocks of the 70 shared tokens, or the ones kept so far by a prompt still
    # prefilling (blocks are kept as each piece completes them)
    assert later and any(r.reused == 64 for r in later) and all(r.reused % 16 == 0 <= 64 for r in later)
    assert s.stats["reused_tokens"] == sum(r.reused for r in later) and s.stats["reused_bytes"] > 0
    assert 0 < s.prefix_cache_bytes and len(s._prefix) * 16 <= 256  # within its budget


def test_prefix_reuse_is_on_by_default_with_a_budget_from_memory(model):
    """Plainly made, the scheduler reuses prefixes (half the memory available, in tokens of
    K / V); 0 turns it off; a cache whose layout cannot hand back token rows has it off and
    says why."""
    s = Scheduler(model, slots=2, max_len=64, kv_cache="fp32")
    assert s.prefix_budget > 0 and s.prefix_budget % s.block == 0
    assert s.prefix_note.startswith(f"prefix reuse: up to {s.prefix_budget} tokens")
    assert Scheduler(model, slots=2, max_len=64, prefix_cache_tokens=0).prefix_note == "prefix reuse off"
    tiled = Scheduler(model, slots=2, max_len=64, kv_cache="int8", kv_kernel="tile")
    assert tiled.prefix_budget == 0 and "keeps K / V in tiles" in tiled.prefix_note
    ref = Scheduler(model, slots=2, max_len=64, kv_cache="int4-kivi")
    assert ref.prefix_budget == 0 and "quantized across tokens" in ref.prefix_note


def test_prefix_reuse_on_a_model_with_sliding_windows(tmp_path):
    """A tiny Gemma 3 (windows of 24 tokens in two of three layers): a kept prefix longer than
    the window is reused, each ring layer getting its last 24 tokens back, and no token
    changes."""
    pytest.importorskip("transformers")
    from tiny_models import save_tiny
    from workbench.model.loaders import gguf_tokenizer

    save_tiny("gemma3", tmp_path, gguf_tokenizer())
    gemma = wb.load_model(str(tmp_path), max_seq_len=256)
    shared = sample_prompts(gemma.tokenizer, 70, 1)[0]
    requests = [(shared + [300 + i] * (1 + i), 6) for i in range(5)]
    s = Scheduler(gemma, slots=2, max_len=128, chunk=32, kv_cache="fp32", prefix_cache_tokens=512, block=16)
    handles = arrive_and_run(s, requests, seed=3)
    for (prompt, n), r in zip(requests, handles):
        assert r.output == alone(gemma, prompt, n)
    assert any(r.reused == 64 for r in handles)  # 4 whole blocks: each ring layer gets its last 24 tokens back
    # pieces of at most a window less a block (8 tokens), so every block was whole in the
    # rings after some piece, and kept for every layer
    assert s.piece_limit == 8
    assert all(k is not None for block in s._prefix.values() for k in block.keys)


def test_a_reused_prefix_is_exact_on_a_quantized_cache_too(model):
    """int8 K / V copied out of one row and into another are the same bytes and scales: with
    reuse on and off the tokens agree."""
    shared = sample_prompts(model.tokenizer, 40, 1)[0]
    requests = [(shared + [t], 5) for t in (100, 200, 300)]
    outs = []
    for budget in (0, 128):
        s = Scheduler(model, slots=1, max_len=64, kv_cache="int8", kv_kernel="dot", prefix_cache_tokens=budget)
        outs.append([r.output for r in arrive_and_run(s, requests)])
    assert outs[0] == outs[1]


def test_sampled_requests_draw_from_their_own_generator(model):
    """A request's sampling (temperature, top_k, top_p, seed) is its own: the same seed gives
    the same tokens alone and in a batch with greedy neighbours (fp32 weights and cache), seeds
    differ in what they draw, top_k 1 is greedy, and greedy neighbours keep their tokens."""
    from workbench.serving import Sampling

    prompts = sample_prompts(model.tokenizer, 24, 4)
    hot = Sampling(temperature=1.2, top_p=0.98, seed=11)

    def run(requests):
        s = Scheduler(model, slots=4, max_len=96, chunk=16, kv_cache="fp32")
        handles = [s.submit(p, 16, stop_at_eos=False, sampling=smp) for p, smp in requests]
        while s.busy:
            s.step()
        return [r.output for r in handles]

    alone_hot = run([(prompts[0], hot)])[0]
    mixed = run([(prompts[0], hot), (prompts[1], Sampling()), (prompts[2], Sampling(temperature=0.8, top_k=1)),
                 (prompts[3], Sampling(temperature=1.2, top_p=0.98, seed=12))])
    assert mixed[0] == alone_hot  # its own draws, whatever else is in the batch
    assert mixed[1] == alone(model, prompts[1], 16) and mixed[2] == alone(model, prompts[2], 16)
    assert run([(prompts[0], Sampling(temperature=1.2, top_p=0.98, seed=12))])[0] != alone_hot
    for bad, message in ((dict(temperature=-1), "temperature must be a number in 0..100"),
                         (dict(top_k=-2), "top_k must be a non-negative integer"),
                         (dict(top_p=0), "top_p must be a number in \\(0, 1\\]"),
                         (dict(seed=1.5), "seed must be a non-negative integer")):
        with pytest.raises(ValueError, match=message):
            Sampling(**bad)


def test_bad_requests_and_settings_are_clear(model):
    s = Scheduler(model, slots=1, max_len=32, max_queue=2)
    with pytest.raises(ValueError, match="prompt must be a non-empty list"):
        s.submit([], 4)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1, got 0"):
        s.submit([1, 2], 0)
    with pytest.raises(ValueError, match="exceeds max_len \\(32\\)"):
        s.submit(list(range(1, 30)), 8)
    with pytest.raises(ValueError, match="token ids in 0.."):
        s.submit([-1], 2)
    s.submit([1, 2], 2), s.submit([3, 4], 2)
    with pytest.raises(QueueFull, match="max_queue 2"):
        s.submit([5], 2)
    with pytest.raises(ValueError, match="slots must be an integer >= 1, got 0"):
        Scheduler(model, slots=0)
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        Scheduler(model, kv_cache="int3")
    with pytest.raises(ValueError, match="prefix reuse copies token rows"):
        Scheduler(model, kv_cache="int8", kv_kernel="tile", prefix_cache_tokens=64)
    first = s.waiting[0]
    s.cancel(first)
    assert first.done and first.finish_reason == "cancelled" and len(s.waiting) == 1
    s.run()
    assert not s.busy


def test_a_reference_format_serves_without_reuse_and_refuses_reuse_clearly(model):
    s = Scheduler(model, slots=2, max_len=48, kv_cache="int4-kivi")
    handles = arrive_and_run(s, [([1, 2, 3, 4, 5], 4), ([6, 7, 8], 3)])
    assert [len(r.output) for r in handles] == [4, 3] and s.stats["decode_paths"] == {"reference"}
    with pytest.raises(ValueError, match="reference format quantized across tokens"):
        Scheduler(model, kv_cache="int4-kivi", prefix_cache_tokens=64)


def test_a_runs_summary_goodput_and_overload_from_given_latencies():
    """serve_bench's arithmetic on fixed outcomes (no clock): percentiles by nearest rank,
    TPOT after the first token, goodput against each SLO, hang-ups counted as answered, and the
    overload flag for a refusal or a served rate under 90% of the offered one."""
    from workbench.analysis.serve_bench import Outcome, summarize_run

    def served(ttft, e2e, tokens):
        return Outcome(200, ttft, e2e, [ttft + 0.1 * i for i in range(tokens)], tokens)

    outcomes = [served(0.2, 1.1, 10), served(0.5, 2.3, 10), served(1.5, 2.4, 10),
                Outcome(200, 0.3, None, [0.3], 1, hung_up=True), Outcome(429)]
    row = summarize_run(outcomes, 2.0, rate=2.0, slo_ttft_s=1.0, slo_tpot_s=0.15)
    assert row["completed"] == 3 and row["hung_up"] == 1 and row["statuses"] == {"200": 3, "hung up": 1, "429": 1}
    assert row["output_tokens"] == 30 and row["output_tokens_per_s"] == 15.0 and row["requests_per_s"] == 1.5
    assert row["ttft_s"]["p50"] == 0.5 and row["ttft_s"]["p99"] == 1.5
    assert row["tpot_s"]["p50"] == pytest.approx(0.1)  # (1.1 - 0.2) / 9, (2.4 - 1.5) / 9 and (2.3 - 0.5) / 9
    assert row["itl_s"]["p50"] == pytest.approx(0.1)
    # the first meets both SLOs; the second misses TPOT (0.2 s), the third TTFT
    assert row["goodput_requests_per_s"] == 0.5
    assert row["overloaded"]  # one refused
    fine = summarize_run(outcomes[:3], 2.0, rate=1.6)
    assert not fine["overloaded"] and fine["goodput_requests_per_s"] == 1.5  # no SLOs: every served request
    assert summarize_run(outcomes[:3], 2.0, rate=1.7)["overloaded"]  # 1.5 served / s < 90% of 1.7


def _sweep_rows(scale: float = 1.0) -> list[dict]:
    """Three loads of a sweep as serve_bench writes them (fixed numbers; no server)."""
    from workbench.analysis.serve_bench import Outcome, summarize_run

    rows = []
    for rate, ttft, overloaded_by in ((1.0, 0.2, 1.0), (2.0, 0.4, 1.0), (4.0, 2.0, 0.5)):
        outcomes = [Outcome(200, scale * ttft, scale * (ttft + 1), [scale * (ttft + 0.1 * i) for i in range(10)], 10)
                    for _ in range(8)]
        wall = 8 / (rate * overloaded_by)  # the last load: served at half the offered rate
        rows.append({"kind": "serve_bench", "label": "ours", "url": "http://127.0.0.1:1", "rate": rate,
                     "concurrency": None, "burstiness": 1.0, "num_requests": 8, "prompt_tokens": 64, "max_tokens": 10,
                     "shared_prefix_tokens": 0, "shared_fraction": 0.0, "hang_up_fraction": 0.0,
                     "slo_ttft_s": None, "slo_tpot_s": None, **summarize_run(outcomes, wall, rate=rate)})
    return rows


def test_a_sweep_has_a_knee_a_figure_a_report_section_and_compares():
    """A sweep over rates as a user shares it: the knee (the last rate kept up with, the first
    fallen behind), the latency-throughput figure, the report's section and findings, a JSON
    that validates, and `workbench compare` matching loads between two reports."""
    import json
    from pathlib import Path

    from workbench.analysis.serve_bench import knee
    from workbench.report import compare as cmp
    from workbench.report.collect import build
    from workbench.report.render import html_page
    from workbench.ui.plots import knee_spec

    rows = _sweep_rows()
    k = knee(rows)
    assert k["kept_up"]["rate"] == 2.0 and k["fell_behind"]["rate"] == 4.0
    assert knee([{**rows[0], "rate": None, "concurrency": 8}]) is None  # no rates, no knee

    spec = knee_spec(rows)
    assert [t["name"] for t in spec["data"]] == ["TTFT p50", "TTFT p99", "TPOT p50 (right)"]
    xs = spec["data"][0]["x"]
    assert xs == sorted(xs) and spec["data"][0]["y"][0] == pytest.approx(200)  # ms
    assert spec["data"][0]["marker"]["symbol"][-1] == "x"  # the load it fell behind on

    entry = {"kind": "serve_bench", "time": "2026-12-03T00:00:00+0000", "model": None, "rows": rows,
             "command": "%serve start --slots 8\n%serve_bench --rate 1,2,4\n%serve stop"}
    report = build([entry], title="sweep")
    schema = json.loads((Path(wb.__file__).parent / "report" / "schema.json").read_text())
    pytest.importorskip("jsonschema").validate(json.loads(json.dumps(report)), schema)
    page = html_page(report)
    assert "fig-serve-0" in page and "kept up with 2 req/s" in page and "fell behind at 4 req/s" in page

    slower = build([{**entry, "rows": _sweep_rows(scale=2.0)}], title="slower")
    found = {r["measurement"]: r for r in cmp.compare(report, slower)}
    ttft = found["serve ours 1 req/s prompt 64 max 10 shared 0x0 | TTFT p50 ms"]
    assert ttft["a"] == pytest.approx(200) and ttft["ratio_b_over_a"] == pytest.approx(2.0)
    assert ttft["verdict"] == "no spread"  # one run per load: a ratio, no verdict


def test_synthetic_prompts_and_output_lengths_within_the_range_asked():
    """range_ratio r: each prompt's words and each request's max_tokens drawn uniformly from
    [n (1 - r), n (1 + r)], the same for the same seed; r = 0 leaves every prompt as before
    (prompt_tokens words after its "[i]" tag) and draws nothing."""
    from workbench.analysis.serve_bench import drawn_lengths, synthetic_prompts

    plain = synthetic_prompts(40, 20, seed=7)
    assert all(len(p.split()) == 21 for p in plain)
    assert synthetic_prompts(40, 20, seed=7, range_ratio=0.0) == plain
    ranged = synthetic_prompts(40, 20, seed=7, range_ratio=0.5)
    words = [len(p.split()) - 1 for p in ranged]
    assert all(10 <= n <= 30 for n in words) and len(set(words)) > 5
    assert synthetic_prompts(40, 20, seed=7, range_ratio=0.5) == ranged
    assert drawn_lengths(5, 8, 0.0, random.Random(0)) == [8] * 5
    outs = drawn_lengths(200, 2, 0.9, random.Random(0))
    assert min(outs) == 1 and max(outs) == 4  # never below one token


def test_a_prompts_file_is_read_or_refused_with_the_line_named(tmp_path):
    from workbench.analysis.serve_bench import load_prompts, serve_bench

    text = tmp_path / "p.txt"
    text.write_text("first prompt\n\n  second one  \n")
    assert load_prompts(text) == [{"prompt": "first prompt", "max_tokens": None},
                                  {"prompt": "  second one  ", "max_tokens": None}]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a", "max_tokens": 4}\n{"prompt": "b"}\n')
    assert load_prompts(jsonl) == [{"prompt": "a", "max_tokens": 4}, {"prompt": "b", "max_tokens": None}]
    for body, message in (("{oops\n", "line 1 is not JSON"), ('{"prompt": ""}\n', "non-empty string"),
                          ('{"prompt": "a", "n": 1}\n', r"unknown fields \['n'\]"),
                          ('{"prompt": "a", "max_tokens": 0}\n', "positive integer, got 0"),
                          ('\n\n', "holds no prompts")):
        jsonl.write_text(body)
        with pytest.raises(ValueError, match=message):
            load_prompts(jsonl)
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(tmp_path / "missing.txt")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(ValueError, match="UTF-8"):
        load_prompts(tmp_path / "latin1.txt")
    # refused before any request is sent (no server at this address)
    with pytest.raises(ValueError, match="range_ratio must be in"):
        serve_bench("http://127.0.0.1:9", range_ratio=1.0)
    with pytest.raises(ValueError, match="do not go together"):
        serve_bench("http://127.0.0.1:9", prompts_file=str(text), shared_prefix_tokens=10)


def test_the_prefix_hit_rate_of_a_run_from_two_scrapes_of_the_servers_counters():
    """Ours counts prompt tokens, reused tokens and bytes; vLLM counts queried and hit tokens
    per engine (labels summed); a server with neither (llama.cpp's) has no hit rate."""
    from workbench.analysis.serve_bench import prefix_reuse
    from workbench.serving.process import metric_counters

    ours = metric_counters("# HELP x\nworkbench_prompt_tokens_total 100\nworkbench_prefix_reused_tokens_total 20\n"
                           "workbench_prefix_reused_bytes_total 4096\n")
    later = {**ours, "workbench_prompt_tokens_total": 300.0, "workbench_prefix_reused_tokens_total": 120.0,
             "workbench_prefix_reused_bytes_total": 12288.0}
    assert prefix_reuse(ours, later) == {"prefix_hit_rate": 0.5, "prefix_reused_tokens": 100,
                                         "prefix_reused_bytes": 8192}
    vllm = metric_counters('vllm:prefix_cache_queries_total{engine="0",model_name="m"} 50.0\n'
                           'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 30.0\n'
                           'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 16.0\n')
    assert vllm == {"vllm:prefix_cache_queries_total": 80.0, "vllm:prefix_cache_hits_total": 16.0}
    assert prefix_reuse({}, vllm) == {"prefix_hit_rate": 0.2, "prefix_reused_tokens": 16, "prefix_reused_bytes": None}
    assert prefix_reuse({}, {"llamacpp:tokens_predicted_total": 5.0})["prefix_hit_rate"] is None
    assert prefix_reuse(ours, ours)["prefix_hit_rate"] is None  # nothing looked up in the run
