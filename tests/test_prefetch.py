"""The per-host software-prefetch choice: measured with the decode kernel, cached, applied
to the native build at load; the kernels' results do not depend on it."""

from __future__ import annotations

import json

import pytest
import torch

from workbench import kernels
from workbench.kernels import prefetch
from workbench.kernels import KernelSet


def test_the_native_build_runs_with_the_measured_choice():
    ext = kernels.native.ext
    found = json.loads(prefetch._path().read_text())  # measured when the build was loaded
    assert ext.get_prefetch() == (found["bytes"], found["hint"], found["pipeline"])
    assert set(found["gbps"]) == {":".join(map(str, c)) for c in prefetch.CANDIDATES}
    assert f"{found['bytes']}:{found['hint']}:{int(found['pipeline'])}" == _kept(found, prefetch.CANDIDATES)
    assert kernels.native.ext is ext and "prefetch" in kernels.build_info()


def _kept(found: dict, candidates) -> str:
    """The candidate the rule keeps, from the measurement's own rounds."""
    seconds = {k: [1 / g for g in rounds] for k, rounds in found["rounds_gbps"].items()}
    assert set(seconds) == {":".join(map(str, c)) for c in candidates}
    return prefetch.choose(seconds, ":".join(map(str, candidates[0])))


def test_a_prefetch_is_kept_only_if_it_beat_none_beyond_the_spread():
    """A tie with no prefetch (ahead in its best round by chance) is not a reason to prefetch:
    it cost two tensor-parallel ranks a few percent of their step (docs/distributed.md). Nor
    is winning each round where no prefetch had one slow round: the candidate's slowest round
    must beat no prefetch's fastest."""
    off = "0:0:0"
    # of two winners, the faster at the median, not the one with the one best round
    assert prefetch.choose({off: [1.0, 1.0, 1.0], "a": [0.9, 0.95, 0.99], "b": [0.8, 0.99, 0.99]}, off) == "a"
    assert prefetch.choose({off: [1.0, 1.0, 1.0], "a": [0.5, 0.99, 1.01]}, off) == off  # lost one round
    assert prefetch.choose({off: [1.0, 1.0], "a": [1.0, 0.9]}, off) == off  # a tie is not a win
    assert prefetch.choose({off: [1.0], "a": [2.0]}, off) == off
    # ahead of off in every round, but only because one of off's rounds was slow: within the spread
    assert prefetch.choose({off: [1.0, 2.0, 1.1], "a": [0.98, 1.05, 1.0]}, off) == off


@pytest.mark.parametrize("bytes_ahead, hint, pipeline", prefetch.CANDIDATES)
def test_results_do_not_depend_on_the_prefetch(bytes_ahead, hint, pipeline):
    """Both decode kernels, the tiled one with the pipelined streams on and off, ragged
    lengths and splits (so tasks of different spans follow each other on a thread)."""
    from test_decode_attention import build_tiled

    ks = KernelSet("native")
    before = ks.ext.get_prefetch()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 64, generator=gen)
    rows, scales, tiles, tiled_scales = build_tiled(ks, 2, 2, 300, 64, gen)
    lengths = torch.tensor([300, 123])

    def run():
        plain = ks.decode_attention(q, rows["k"], rows["v"], lengths, **scales)
        tiled = [ks.decode_attention(q, tiles["k"], tiles["v"], lengths, **tiled_scales, int8_kernel="tile",
                                     num_splits=s) for s in (1, 3)]
        return plain, *tiled

    ref = run()
    try:
        ks.ext.set_prefetch(bytes_ahead, hint, bool(pipeline))
        out = run()
    finally:
        ks.ext.set_prefetch(*before)
    for a, b in zip(out, ref):
        assert torch.equal(a, b)


def test_bad_prefetch_settings_are_refused():
    with pytest.raises(ValueError, match="hint in 0..3"):
        kernels.native.ext.set_prefetch(4096, 7)


def test_the_matrix_vector_kernel_runs_with_its_measured_choice_per_weight_type():
    """The row order kept by the rule from its own rounds, then the prefetch kept in that order."""
    ext = kernels.native.ext
    found = json.loads(prefetch._path().read_text())["matvec"]
    sizes = {"float32": 4, "bfloat16": 2, "int8": 1}
    assert set(found) == set(sizes)
    for name, mv in found.items():
        setting = (mv["bytes"], mv["hint"], mv["max_chunk_bytes"], mv["serial_max_chunk_bytes"])
        assert ext.get_matvec_prefetch(name) == setting
        assert str(setting[3] // sizes[name]) == _kept(mv["order"], prefetch.MATVEC_ORDERS)
        assert ":".join(map(str, setting[:3])) == _kept(mv["prefetch"], prefetch.MATVEC_PREFETCH)
        assert kernels.build_info()["matvec_prefetch"][name]["serial_max_chunk_bytes"] == setting[3]


@pytest.mark.parametrize("serial_bytes", [0, 1 << 30])
@pytest.mark.parametrize("setting", prefetch.MATVEC_PREFETCH)
def test_linear_results_do_not_depend_on_the_prefetch(setting, serial_bytes):
    """Bit for bit, in either row order (the order changes the summation order, so the two
    orders are each checked against float64 in test_linear.py instead)."""
    ks = KernelSet("native")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 576, generator=gen)
    w8, s8 = kernels.quantize_weight_int8(torch.randn(72, 1536, generator=gen), 32)
    cases = {"float32": (x, torch.randn(96, 576, generator=gen), None),
             "bfloat16": (torch.randn(3, 1536, generator=gen), torch.randn(40, 1536, generator=gen).bfloat16(), None),
             "int8": (torch.randn(2, 1536, generator=gen), w8, s8)}
    for name, (xi, w, scale) in cases.items():
        before = ks.ext.get_matvec_prefetch(name)
        try:
            ks.ext.set_matvec_prefetch(name, 0, 0, 0, serial_bytes)
            ref = ks.linear(xi, w, scale=scale)
            ks.ext.set_matvec_prefetch(name, *setting, serial_bytes)
            out = ks.linear(xi, w, scale=scale)
        finally:
            ks.ext.set_matvec_prefetch(name, *before)
        assert torch.equal(out, ref), name


def test_bad_matvec_prefetch_settings_are_refused():
    with pytest.raises(ValueError, match="hint in 0..3"):
        kernels.native.ext.set_matvec_prefetch("float32", 4096, 9, 3072)
    with pytest.raises(ValueError, match="max_chunk_bytes >= 0"):
        kernels.native.ext.set_matvec_prefetch("bfloat16", 4096, 3, -1)
    with pytest.raises(ValueError, match="serial_max_chunk_bytes >= 0, got 4096, 3, 3072, -2"):
        kernels.native.ext.set_matvec_prefetch("bfloat16", 4096, 3, 3072, -2)
    with pytest.raises(ValueError, match="weights must be 'float32', 'bfloat16' or 'int8', got 'fp16'"):
        kernels.native.ext.set_matvec_prefetch("fp16", 4096, 3, 3072)
