"""The analysis layer's measurements of quality, checked for what they must be by
construction (the reference against itself) and for sense (a quantized cache differs)."""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from workbench.analysis.quality import kv_quality
from workbench.analysis.tables import format_table


@pytest.fixture(scope="module")
def model():
    return wb.load_model("smollm2-135m")


def test_kv_quality_against_the_fp32_cache(model):
    rows = {r["kv_cache"]: r for r in kv_quality(model, ("fp32", "int8", "bf16"), context=256, steps=24)}
    ref = rows["fp32"]
    assert ref["kl_nats"] == 0 and ref["top1_agreement_vs_fp32"] == 1 and ref["positions"] == 23
    assert rows["int8"]["kl_nats"] > 0 and rows["int8"]["kl_nats"] < 0.05  # differs, but only a little
    assert rows["int8"]["bytes_per_element"] == pytest.approx(1 + 4 / 64)  # d = 64: a 4-byte scale per 64 values
    assert 1 < ref["perplexity"] < 100  # a trained model on English text
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        kv_quality(model, ("int4",))
    with pytest.raises(ValueError, match="steps must be"):
        kv_quality(model, context=16, steps=16)


def test_attention_error_separates_the_kernels_own_rounding(model):
    """The probe compares each decode kernel with float64 over the values its cache stores:
    fp32 accumulation alone (fp32, int8 widened, the torch reference path) is ~1e-7, the
    int8 query (the dot kernel) and the 7-bit probabilities (the tile kernel) add errors of
    their own; a plain int8 is read by its default kernel, tile."""
    fmts = ("fp32", "int8:widen", "int8:dot", "int8", "int8-ref")
    rows = {r["cache"]: r for r in kv_quality(model, fmts, context=200, steps=8)}
    assert set(rows) == {"fp32", "int8 (widen)", "int8 (dot)", "int8 (tile)", "int8-ref"}
    for exact in ("fp32", "int8 (widen)", "int8-ref"):
        assert rows[exact]["attention_rel_error"] < 1e-5, rows[exact]
    for rounded in ("int8 (dot)", "int8 (tile)"):
        assert 1e-4 < rows[rounded]["attention_rel_error"] < 0.05, rows[rounded]


def test_format_table_aligns_and_formats():
    text = format_table([{"a": 1.23456, "b": "x"}, {"a": 10.0, "b": "longer"}], ["a", "b"], {"a": "{:.1f}"})
    lines = text.splitlines()
    assert lines[0].split() == ["a", "b"] and lines[2].split() == ["1.2", "x"] and lines[3].split() == ["10.0", "longer"]
    assert len({line.index(line.split()[1]) for line in (lines[0], lines[2], lines[3])}) == 1  # one column start
    assert format_table([], ["a"]).splitlines() == ["a", "-"]


def test_int8_weights_quality_and_generation(model):
    """Weight-only int8 reported like the KV formats (KL, top-1, perplexity against fp32 on
    real text), and a generation a user would recognise."""
    from workbench.analysis.quality import weight_quality

    int8 = wb.load_model("smollm2-135m", dtype="int8")
    assert int8.llama.layers[0].wqkv.weight.dtype == torch.int8 and int8.weight_dtype == "int8"
    q = weight_quality(model, int8, context=256)
    assert q["context"] == 256 and 0 < q["kl_nats"] < 0.05 and q["top1_agreement"] >= 0.9
    assert abs(q["perplexity"] / q["perplexity_reference"] - 1) < 0.1
    assert "Paris" in int8.generate("The capital of France is", max_new_tokens=4).text
    grouped = wb.load_model("smollm2-135m", dtype="int8-g32")  # a scale per 32 weights: closer to fp32
    g = weight_quality(model, grouped, context=256)
    assert g["kl_nats"] < q["kl_nats"] and g["top1_agreement"] >= 0.95


def test_spread_warnings_name_the_rows_the_table_cannot_rank():
    from workbench.analysis.ablation import AblationRow, spread_warnings

    def row(attention, kv, rate, lo, hi, repeats=3):
        return AblationRow(attention, kv, "tile" if kv == "int8" else "widen", 16, 1, 4, 1.0, rate, 1.0, 1.0, 1.0, 1.0,
                           1.0, repeats, 1.0, 1.0, lo, hi)

    apart = [row("slim", "int8", 30.0, 29.0, 31.0), row("flash", "fp16", 20.0, 19.0, 21.0)]
    assert spread_warnings(apart) == []
    close = [row("slim", "int8", 30.0, 22.0, 31.0), row("flash", "fp16", 24.0, 19.0, 25.0)]
    (line,) = spread_warnings(close)
    assert "flash / fp16 (24.0) and slim / int8 (tile) (30.0) overlap" in line
    assert spread_warnings([row("slim", "int8", 30.0, 30.0, 30.0, 1), row("flash", "fp16", 30.0, 30.0, 30.0, 1)]) == []
    # a chain of neighbours that overlap is one line, not one per pair; a gap starts another
    chain = [row("slim", "int8", 30.0, 28.0, 32.0), row("flash", "fp16", 27.0, 25.0, 29.0),
             row("naive", "fp32", 24.0, 22.0, 26.0), row("sdpa", "fp32", 10.0, 9.0, 11.0), row("sdpa", "bf16", 11.0, 10.5, 12.0)]
    first, second = spread_warnings(chain)
    assert "sdpa / fp32 (10.0) and sdpa / bf16 (11.0) overlap" in first
    assert "naive / fp32 (24.0), flash / fp16 (27.0), slim / int8 (tile) (30.0) overlap" in second
