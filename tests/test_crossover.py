"""The matrix-vector / GEMM crossover: measured per host and weight kernel when the kernels
load (workbench/kernels/crossover.py), applied to every linear layer that does not say
otherwise (kernels.linear, the fused decode step), shown by --info, and refused when set to
something that is not a weight kernel or a row count."""

from __future__ import annotations

import json

import pytest
import torch

from workbench import kernels
from workbench.kernels import _build, crossover

KERNELS = ("float32", "bfloat16", "int8", "int8_group")


def test_the_crossover_makes_the_measured_counts_fastest_together():
    t = lambda mv, g: {"matvec": mv, "gemm": g}  # noqa: E731
    assert crossover.decide({2: t(1, 2), 3: t(1, 2)}) == (3, False)
    assert crossover.decide({2: t(1, 2), 3: t(2, 1), 4: t(2, 1)}) == (2, True)
    # one noisy count does not move it: the GEMM ahead at 2, 4 and 6, the matrix-vector kernel at 3 by little
    assert crossover.decide({2: t(2.17, 1.79), 3: t(2.53, 2.75), 4: t(3.05, 2.26), 6: t(3.48, 2.71)}) == (1, True)
    # a GEMM win alone is not a reason to stop; the counts on either side decide
    assert crossover.decide({2: t(1, 2), 3: t(2, 1.9), 4: t(1, 2), 6: t(2, 1)}) == (4, False)
    assert crossover.decide({2: t(2, 1), 3: t(2, 1)}) == (1, True)  # the GEMM from 2 rows: batch 1 stays


def test_the_native_build_runs_the_crossover_measured_here():
    ext = kernels.native.ext
    path = crossover._path(_build._sources_key("native"))
    found = json.loads(path.read_text())
    assert found["version"] == crossover.VERSION and set(found["kernels"]) == set(ext.constants()["weight_kernels"])
    info = kernels.build_info()["matvec_max_rows"]
    for kernel, choice in found["kernels"].items():
        assert choice["engine"] == ext.gemm_engine_for(kernel)
        ms = {int(m): t for m, t in choice["ms"].items()}
        assert crossover.decide(ms)[0] == choice["rows"]  # the file's choice follows from its own times
        assert choice["rows"] in (1, *crossover.ROWS)
        assert kernels.matvec_max_rows(kernel) == info[kernel] == choice["rows"]


@pytest.fixture
def restore_crossover():
    before = {k: kernels.matvec_max_rows(k) for k in KERNELS}
    yield
    for k, rows in before.items():
        kernels.native.ext.set_matvec_max_rows(k, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_linear_takes_the_crossover_of_its_weights(restore_crossover, dtype):
    """With no matvec_max_rows, linear runs whichever kernel the table says for the weights'
    dtype: bit for bit the output of asking for that kernel explicitly."""
    x = torch.randn(6, 96)
    w = torch.randn(40, 96)
    scale = None
    if dtype == torch.int8:
        w, scale = kernels.quantize_weight_int8(w)
    else:
        w = w.to(dtype)
    kernel = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int8: "int8"}[dtype]
    for rows in (1, 6, 64):
        kernels.native.ext.set_matvec_max_rows(kernel, rows)
        assert kernels.matvec_max_rows(kernel) == rows
        assert torch.equal(kernels.linear(x, w, scale=scale), kernels.linear(x, w, scale=scale, matvec_max_rows=rows))


def test_bad_crossover_settings_are_refused(restore_crossover):
    with pytest.raises(ValueError, match="set_matvec_max_rows: kernel must be one of 'float32', 'bfloat16', 'int8', 'int8_group', 'q4_0', .*, got 'fp16'"):
        kernels.native.ext.set_matvec_max_rows("fp16", 4)
    with pytest.raises(ValueError, match="rows must be >= 1 .* got 0"):
        kernels.native.ext.set_matvec_max_rows("bfloat16", 0)
    with pytest.raises(ValueError, match="got 'int4'"):
        kernels.matvec_max_rows("int4")
