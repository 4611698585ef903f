"""The measured peaks every benchmark divides by: measured with the kernels' probes, cached
per machine and thread count, measured again when asked or when the cache is damaged.
(What they measure is checked for sense, never for speed.)"""

from __future__ import annotations

import json
import math

import torch

from workbench.kernels import peaks


def test_peaks_are_measured_cached_and_remeasured(tmp_path, monkeypatch):
    path = tmp_path / "peaks.json"
    monkeypatch.setattr(peaks, "_cache_path", lambda: path)

    first = peaks.measured_peaks(refresh=True)
    assert first.threads == torch.get_num_threads()
    for name in ("triad_gbps", "triad_gbps_1t", "read_gbps", "fma_gflops", "fma_gflops_1t"):
        value = getattr(first, name)
        assert math.isfinite(value) and value > 0, (name, value)
    assert json.loads(path.read_text()) == first.as_dict()
    # the bf16 units: measured where the CPU (and for AMX, the kernel) lets them run, else 0
    # with the reason; a unit's peak is what compute_peak_gflops gives for its engine
    from workbench.kernels import gemm_engines

    can = gemm_engines()
    for engine, value in (("amx_bf16", first.amx_bf16_gflops), ("avx512_bf16", first.avx512_bf16_gflops)):
        assert (math.isfinite(value) and value > 0) if can[engine][0] else value == 0, (engine, value)
        assert first.compute_peak_gflops(engine) == value
    assert first.amx_reason == can["amx_bf16"][1]
    assert first.compute_peak_gflops("fma") == first.fma_gflops
    from workbench.kernels import native  # AMX int8: measured where the tiles and the CPU allow it

    int8_ok, int8_why = native.ext.amx_int8_status()
    assert first.amx_int8_reason == int8_why and isinstance(int8_why, str) and int8_why
    assert (math.isfinite(first.amx_int8_gops) and first.amx_int8_gops > 0) if int8_ok else first.amx_int8_gops == 0
    assert first.compute_peak_gflops("amx_int8") == first.amx_int8_gops
    if int8_ok:
        assert can["amx_bf16"][0]  # int8 tiles only where the tile state was granted

    assert peaks.measured_peaks() == first  # from the cache, not measured again

    path.write_text("{not json")
    again = peaks.measured_peaks()  # a damaged cache is measured again and rewritten
    assert again.measured_at and json.loads(path.read_text()) == again.as_dict()


def test_an_emulated_process_measures_the_machine_not_the_emulation():
    """On the test build "emulated" every vector instruction of the kernels is C++, so its
    speed is no peak: a process running that build ($WORKBENCH_KERNELS_BUILD) measures the
    bandwidth and FMA peaks with the native build's probes, and its emulated matrix engines
    report no peak (0), as engines that may not run do."""
    import os
    import subprocess
    import sys

    import pytest

    from workbench.kernels import KernelSet
    from workbench.kernels._build import emulation_runs_here

    if not emulation_runs_here():
        pytest.skip("the emulated build needs AVX2, FMA and F16C")
    KernelSet("emulated").ext  # built here, where the test's failure would name a build error
    code = ("from workbench.kernels import native, peaks\n"
            "probe = peaks.probe_kernels()\n"
            "print(native.variant, native.ext.isa(), probe.variant, probe.ext.isa())\n"
            "print(peaks.measure_amx_bf16_gflops(1, iterations=10, repeats=1)[0],"
            " peaks.measure_avx512_bf16_gflops(1, iterations=10, repeats=1),"
            " peaks.measure_amx_int8_gops(1, iterations=10, repeats=1)[0],"
            " peaks.measure_fma_gflops(1, iterations=1000, repeats=1) > 0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "WORKBENCH_KERNELS_BUILD": "emulated"})
    assert done.returncode == 0, done.stderr
    builds, engines = done.stdout.split("\n")[:2]
    assert builds == f"emulated avx512 native {KernelSet('native').ext.isa()}"
    assert engines == "0.0 0.0 0.0 True"
