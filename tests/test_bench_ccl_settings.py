"""bench/ccl_settings.py run as a user runs it, at the smallest size: two ranks per setting,
the workbench's own environment in every round, a setting oneCCL refuses reported as failed
rather than ending the run, and nothing of its ranks left in /dev/shm."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.distributed import ccl

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs for 2 ranks")


def test_ccl_settings_bench_times_each_setting_against_the_workbench_environment(tmp_path):
    if not ccl.available():
        if os.environ.get("CI"):
            pytest.fail("CI installs the ccl extra (scripts/bootstrap): " + ccl.INSTALL_HINT)
        pytest.skip(ccl.INSTALL_HINT)
    # the binding built once here, not by both ranks of the first round at once
    subprocess.run([sys.executable, "-c", "from workbench.distributed import ccl; ccl.extension()"], check=True)
    settings = {"CCL_YIELD=pause": {"CCL_YIELD": "pause"}, "no such provider": {"FI_PROVIDER": "nonexistent"}}
    shm_before = set(os.listdir("/dev/shm"))
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "ccl_settings.py"), "--rounds", "2", "--calls", "20",
                        "--floats", "8,576", "--settings", json.dumps(settings), "--out", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "oneCCL's step all-reduce, 2 ranks, 20 calls in a row" in r.stdout
    rows = {row["setting"]: row for row in json.loads((tmp_path / "ccl_settings.json").read_text())["rows"]}
    assert list(rows) == ["workbench", "CCL_YIELD=pause", "no such provider"]
    for name in ("workbench", "CCL_YIELD=pause"):
        for n in ("8", "576"):
            cell = rows[name][n]
            assert 0 < cell["min_us"] <= cell["median_us"] <= cell["max_us"]
    assert rows["workbench"]["576"]["vs_workbench"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    assert "failed" in rows["no such provider"] and "8" not in rows["no such provider"]
    # the refused setting's ranks die by SIGABRT inside oneCCL, which once left libfabric's
    # 64 MiB region of each (/dev/shm/<pid>:0:0) for good
    left = [name for name in set(os.listdir("/dev/shm")) - shm_before if re.match(r"\d+:", name)]
    assert left == [], left
