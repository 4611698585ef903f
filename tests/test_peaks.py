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

    assert peaks.measured_peaks() == first  # from the cache, not measured again

    path.write_text("{not json")
    again = peaks.measured_peaks()  # a damaged cache is measured again and rewritten
    assert again.measured_at and json.loads(path.read_text()) == again.as_dict()
