"""The cost model (wb.predict): it counts exactly the bytes and FLOPs the runtime's step
records count, from the configuration alone; its roofline, communication and comparison
behave as stated; bad input is a clear error."""

from __future__ import annotations

import math

import pytest

import workbench as wb
from workbench.analysis.costmodel import Hardware, predict, predict_run, table2_projection
from workbench.model.kv_formats import KV_FORMATS
from workbench.model.weights import WEIGHT_FORMATS

HW = Hardware("test", bandwidth_gbps=20.0, fma_gflops=200.0, comm_alpha_us=5.0, comm_beta_gbps=8.0,
              cache_bytes=0)


@pytest.fixture(scope="module")
def models():
    return {d: wb.load_model("smollm2-135m", dtype=d) for d in WEIGHT_FORMATS}


@pytest.mark.parametrize("dtype", list(WEIGHT_FORMATS))
@pytest.mark.parametrize("kv", list(KV_FORMATS))
def test_bytes_and_flops_equal_the_step_records(models, dtype, kv):
    model = models[dtype]
    prompts = [list(range(100, 117)), list(range(200, 217))]  # batch 2, 17 tokens each
    out = model.generate(prompts, max_new_tokens=7, kv_cache=kv, stop_at_eos=False)
    p = predict(model, batch=2, prompt_len=17, new_tokens=7, kv_cache=kv, hardware=HW)
    prefill, decode = out.timings.prefill, out.timings.decode_steps
    assert p.step_bytes("prefill") == prefill.bytes_read
    assert p.step_flops("prefill") == prefill.total_flops
    # decode is predicted at the mean KV length of the decode steps: their mean bytes / FLOPs (the
    # records round each layer's KV bytes down to whole bytes: at most one byte per layer apart)
    assert p.step_bytes("decode") == pytest.approx(sum(s.bytes_read for s in decode) / len(decode),
                                                   abs=model.config.n_layers)
    assert p.step_flops("decode") == pytest.approx(sum(s.total_flops for s in decode) / len(decode), rel=1e-9)


@pytest.mark.parametrize("dtype", list(WEIGHT_FORMATS))
def test_the_loaders_estimate_counts_what_the_model_holds(models, dtype):
    """ModelConfig.weight_bytes (the loaders' memory check) from the format record equals the
    bytes the loaded model holds: int8 scales included, the embedding kept apart when the
    quantized LM head no longer is it."""
    model = models[dtype]
    assert model.config.weight_bytes(WEIGHT_FORMATS[dtype]) == model.llama.weight_bytes


def test_a_distributed_prediction_starts_no_process(tmp_path, monkeypatch):
    """With no all-reduce fit cached, predicting for 2 ranks says how to measure one and
    starts nothing (it used to start ipyparallel engines to measure one)."""
    import multiprocessing
    import subprocess

    started = []
    monkeypatch.setattr(subprocess.Popen, "__init__", lambda self, *a, **k: started.append(a) or 1 / 0)
    monkeypatch.setattr(multiprocessing.Process, "start", lambda self: started.append(self) or 1 / 0)
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=r"no all-reduce fit of shm on 2 ranks.*wb\.measure_allreduce\('shm', ranks=2\)"):
        wb.predict("smollm2-135m", ranks=2, backend="shm")
    assert started == []


def test_roofline_names_the_bound_and_adds_communication():
    p = predict("llama2-7b", batch=1, prompt_len=1024, new_tokens=128, kv_cache="int8", weight_dtype="bf16",
                hardware=HW)
    att, mlp = p.layers["decode"]["attention"], p.layers["decode"]["mlp"]
    assert att.bound == mlp.bound == "memory"  # batch 1 decode reads every weight for 2 FLOPs each
    assert mlp.seconds == pytest.approx(2 * 3 * 4096 * 11008 / 20e9)
    assert p.layers["prefill"]["mlp"].bound == "compute"  # 1024 tokens per weight read
    assert p.layers["prefill"]["mlp"].seconds == pytest.approx(2 * 1024 * 3 * 4096 * 11008 / 200e9)
    two = predict("llama2-7b", batch=1, prompt_len=1024, new_tokens=128, weight_dtype="bf16", ranks=2, hardware=HW)
    one = predict("llama2-7b", batch=1, prompt_len=1024, new_tokens=128, weight_dtype="bf16", hardware=HW)
    assert two.layers["decode"]["mlp"].bytes * 2 == one.layers["decode"]["mlp"].bytes
    comm = two.layers["decode"]["comm"].comm_s
    assert comm == pytest.approx(2 * (5e-6 + 4 * 4096 / 8e9))  # two all-reduces of dim fp32: alpha + bytes / beta
    assert one.layers["decode"]["comm"].comm_s == 0.0


def test_the_gemms_are_set_against_the_peak_of_the_unit_they_run_on():
    """Prefill's linear FLOPs (more rows than the matrix-vector kernel takes) on the matrix
    engine's roof; under W8A8 (amx_int8) per-row int8 weights on the int8 tiles' roof, grouped
    int8 and bf16 still on the bf16 one; the rest of the part's FLOPs on the FMA roof."""
    tiles = Hardware("tiles", bandwidth_gbps=20.0, fma_gflops=200.0, matrix_gflops=1000.0)
    w8a8 = Hardware("w8a8", bandwidth_gbps=20.0, fma_gflops=200.0, matrix_gflops=1000.0, matrix_int8_gops=2000.0)
    linear = 2 * 1024 * 3 * 4096 * 11008  # gate, up and down of 1024 tokens
    for dtype, hw, roof in (("int8", tiles, 1000), ("int8", w8a8, 2000), ("int8-g32", w8a8, 1000), ("bf16", w8a8, 1000),
                            ("fp32", w8a8, 200)):
        mlp = predict("llama2-7b", prompt_len=1024, new_tokens=8, weight_dtype=dtype, hardware=hw).layers["prefill"]["mlp"]
        assert mlp.compute_s == pytest.approx((mlp.flops - linear) / 200e9 + linear / (roof * 1e9)), (dtype, hw.name)


def test_uneven_head_splits_are_predicted_at_the_busiest_ranks_share():
    """The bundled model's 9 query heads over 2 ranks are 5 + 4, each rank reading 2 of the 3
    KV heads: its attention part is predicted at rank 0's 5 query + 2 KV heads (the ranks
    meet at the all-reduce that ends it), its MLP at half the features (the FFN splits
    evenly), byte for byte what rank 0's shard holds."""
    from workbench.model.config import preset
    from workbench.model.weights import weight_format

    cfg = preset("smollm2-135m")
    two = predict("smollm2-135m", batch=1, prompt_len=64, new_tokens=8, weight_dtype="bf16", ranks=2, hardware=HW)
    d, hd, bf16 = cfg.dim, cfg.head_dim, weight_format("bf16")
    weights = bf16.nbytes((5 + 2 * 2) * hd, d) + bf16.nbytes(d, 5 * hd)  # wq, wk, wv rows; wo columns
    prefill = two.layers["prefill"]["attention"]
    assert prefill.bytes == weights  # prefill's attention reads no cache
    assert two.layers["prefill"]["mlp"].bytes == bf16.nbytes(cfg.ffn_dim, d) + bf16.nbytes(d, cfg.ffn_dim // 2)
    even = predict("llama2-7b", batch=1, prompt_len=64, new_tokens=8, weight_dtype="bf16", ranks=2, hardware=HW)
    one = predict("llama2-7b", batch=1, prompt_len=64, new_tokens=8, weight_dtype="bf16", hardware=HW)
    assert even.layers["prefill"]["attention"].bytes * 2 == one.layers["prefill"]["attention"].bytes  # 32 heads: even


def test_compare_sets_measurement_against_prediction_and_says_why(models):
    model = models["fp32"]
    out = model.generate("The capital of France is", max_new_tokens=8, stop_at_eos=False)
    p = predict_run(model, out)
    rows = p.compare(out.timings)
    parts = {(r["phase"], r["part"]) for r in rows}
    assert {("decode", "attention"), ("decode", "mlp"), ("decode", "other"), ("decode", "head"),
            ("decode", "step"), ("prefill", "step")} <= parts
    assert all(r["ratio"] == pytest.approx(r["measured_ms"] / r["predicted_ms"]) for r in rows)
    for r in rows:  # every part outside 1.5x either way is explained, the others are not
        assert bool(r["why"]) == (not 1 / 1.5 <= r["ratio"] <= 1.5)
    other = next(r for r in rows if r["phase"] == "decode" and r["part"] == "other")
    # norms read ~no bytes, so when the part is flagged the reason named is overhead (whether it is
    # flagged is this run's timing, not asserted)
    assert not other["why"] or "overhead" in other["why"]
    assert "decode" in repr(p) and "bound" in repr(p)


def test_table2_projection_from_stated_socket_parameters():
    socket = Hardware.from_socket("test socket", channels=8, mts=5600, bandwidth_efficiency=0.8, cores=48, ghz=2.0,
                                  flops_per_cycle_per_core=1024, compute_efficiency=0.5, link_alpha_us=50,
                                  link_gbps=10)
    assert socket.bandwidth_gbps == pytest.approx(8 * 5600 * 8 / 1e3 * 0.8)
    two, eight = table2_projection(socket, sockets=(2, 8))
    assert two["bound"] == eight["bound"] == "memory"
    assert eight["memory_ms"] == pytest.approx(two["memory_ms"] / 4, rel=0.05)  # the weights split 4x further
    assert eight["comm_ms"] > two["comm_ms"] > 0  # more hops per all-reduce
    # 70B in bf16 read once per token over 2 sockets' bandwidth
    assert two["memory_ms"] == pytest.approx(2 * 68.98e9 / 2 / (socket.bandwidth_gbps * 1e9) * 1e3, rel=0.02)


@pytest.mark.parametrize("kwargs, message", [
    ({"ranks": 0}, "ranks must be an integer >= 1, got 0"),
    ({"batch": 0}, "batch must be an integer >= 1, got 0"),
    ({"kv_cache": "int3"}, "kv_cache must be one of"),
    ({"weight_dtype": "fp8"}, "dtype must be one of"),
    ({"ranks": 2}, "ranks > 1 needs backend="),
])
def test_bad_input_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        predict("smollm2-135m", **kwargs)
    with pytest.raises(ValueError, match="unknown model preset"):
        predict("llama9-1t")


def test_this_machine_uses_the_measured_peaks():
    from workbench.kernels.peaks import measured_peaks

    hw = Hardware.this_machine(2, comm=(4.0, 8.0))
    peaks = measured_peaks()
    assert hw.bandwidth_gbps == pytest.approx(peaks.triad_gbps / 2) and hw.fma_gflops == pytest.approx(
        peaks.fma_gflops / 2)
    assert hw.comm_alpha_us == 4.0 and not math.isinf(hw.comm_beta_gbps)


def test_the_tp_roofline_ratio_is_the_busiest_ranks_share_plus_the_collectives():
    """tp_roofline_ratio: one rank's predicted decode step on a 1 / ranks share of the machine
    over one process's on all of it. Llama-2-7B's 32 heads split evenly, so with free
    collectives 2 ranks cost what one process does; the bundled model's 5 + 4 query heads
    (rank 0 reading 2 of the 3 KV heads) leave rank 0 14 of the 24 attention units and half
    the FFN and vocabulary, about 3% more than half the bytes, charged whatever the backend."""
    from workbench.analysis.costmodel import tp_roofline_ratio

    free = (0.0, math.inf)
    assert tp_roofline_ratio("llama2-7b", 2, comm=free, weight_dtype="bf16") == pytest.approx(1.0, rel=1e-3)
    d, hd, L, ffn, vocab = 576, 64, 30, 1536, 49152
    rank0 = L * ((2 * 5 + 2 * 2) * hd * d + 3 * (ffn // 2) * d) + vocab // 2 * d
    one = L * ((2 * 9 + 2 * 3) * hd * d + 3 * ffn * d) + vocab * d
    floor = tp_roofline_ratio("smollm2-135m", 2, comm=free, weight_dtype="bf16")
    assert floor == pytest.approx(2 * rank0 / one, rel=0.01) and floor > 1.02
    # With the KV handoff (shm) rank 0 takes KV head 1 from rank 1 instead of computing it:
    # 12 of the 24 units, while still reading both KV heads from its cache.
    handed = L * ((2 * 5 + 2 * 1) * hd * d + 3 * (ffn // 2) * d) + vocab // 2 * d
    with_handoff = tp_roofline_ratio("smollm2-135m", 2, comm=free, weight_dtype="bf16", kv_handoff=True)
    assert with_handoff == pytest.approx(2 * handed / one, rel=0.01) and with_handoff < floor
    assert tp_roofline_ratio("llama2-7b", 2, comm=free, weight_dtype="bf16", kv_handoff=True) == pytest.approx(
        1.0, rel=1e-3)  # whole KV heads: nothing to hand over
    assert tp_roofline_ratio("smollm2-135m", 2, comm=(5.0, 8.0), weight_dtype="bf16") > floor
    with pytest.raises(ValueError, match="backend"):
        tp_roofline_ratio("smollm2-135m", 2)
