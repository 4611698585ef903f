"""simd.h's int8 dot products, every branch, against exact integer sums.

The int8 KV cache's `dot` and `tile` kernels score keys with `dot_i8` (K's signed bytes
against the query's) and weight values with `dot_u7` (probabilities in [0, 127] against V's
signed bytes). Each instruction set computes them its own way: VNNI's `vpdpbusd` needs K
made unsigned (a bias of 128 that the caller takes off again), `pmaddubsw` + `pmaddwd` (AVX2,
and AVX-512 CPUs without VNNI such as Skylake-SP) multiply |k| by q with k's sign, where a
wrong sign or a saturated pair sum would go unnoticed in a softmax. The kernel tests run the
branches a build takes on this host (and the AVX-512 VNNI one on the "emulated" build); this
module compiles a small program around simd.h for every branch, runs each one the host can
(the AVX-512 ones also emulated, so any AVX2 host runs them), and checks every output lane
against the integer sums computed here, extremes (-128, 127, 0) included.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.kernels._build import SOURCE_DIR, emulation_runs_here
from workbench.hw.machine import machine_info

# Reads n, then n cases of 64 bytes each of k, q, p, v; writes kDotIsa, the bias, the lanes
# per vector, then for each case the lanes of dot_i8 and of dot_u7 over the 64 bytes.
PROGRAM = r"""
#include "simd.h"
#include <cstdio>
using namespace wbk;
int main() {
  int n;
  if (std::scanf("%d", &n) != 1) return 2;
  constexpr int lanes = sizeof(VecI) / sizeof(int32_t);
  std::printf("%s %d %d\n", kDotIsa, kDotBias, lanes);
  for (int c = 0; c < n; ++c) {
    int8_t b[4][64];
    for (auto& row : b)
      for (auto& x : row) {
        int y;
        if (std::scanf("%d", &y) != 1) return 2;
        x = static_cast<int8_t>(y);
      }
    VecI s = VecI::zero(), t = VecI::zero();
    for (int i = 0; i < 64; i += I8B) {
      s = dot_i8(s, VecB::load(b[0] + i), VecB::load(b[1] + i));
      t = dot_u7(t, VecB::load(b[2] + i), VecB::load(b[3] + i));
    }
    int32_t out[2][lanes];
    std::memcpy(out[0], &s, sizeof s);
    std::memcpy(out[1], &t, sizeof t);
    for (auto& row : out)
      for (int32_t x : row) std::printf("%d ", x);
    std::printf("\n");
  }
}
"""

_EMULATED = ["-march=x86-64-v3", "-DWBK_EMULATE_ISA", "-Wno-psabi", "-include", str(SOURCE_DIR / "emulate_isa.h")]
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl"]
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]

# branch -> (the name simd.h must report, compiler flags, the CPU flags it needs to run, or
# None for an emulated build: any host that runs the "emulated" kernel build)
BRANCHES = {
    "avx512-vnni, emulated": ("avx512-vnni", _EMULATED, None),
    "avx512bw-maddubs, emulated": ("avx512bw-maddubs", _EMULATED + ["-DWBK_EMULATE_NO_VNNI"], None),
    "avx512-vnni": ("avx512-vnni", _AVX512 + ["-mavx512vnni"], {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
    "avx512bw-maddubs": ("avx512bw-maddubs", _AVX512, {"avx512f", "avx512bw", "avx512vl"}),
    "avx-vnni": ("avx-vnni", _AVX2 + ["-mavxvnni"], {"avx2", "fma", "f16c", "avx_vnni"}),
    "avx2-maddubs": ("avx2-maddubs", _AVX2, {"avx2", "fma", "f16c"}),
    "scalar": ("scalar", ["-march=x86-64"], set()),
}


def _runnable(branch: str) -> str | None:
    """Why `branch` cannot run on this host, or None."""
    needs = BRANCHES[branch][2]
    if needs is None:
        return None if emulation_runs_here() else "the emulated build needs an x86-64-v3 CPU (AVX2, FMA, F16C, BMI2)"
    missing = needs - set(machine_info().flags)
    return f"this CPU lacks {', '.join(sorted(missing))}" if missing else None


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """branch -> the compiled program's path (compiled once, on first use)."""
    folder = tmp_path_factory.mktemp("int8_dot")
    source = folder / "dot.cpp"
    source.write_text(PROGRAM)
    built: dict[str, str] = {}

    def program(branch: str) -> str:
        if branch not in built:
            exe = folder / branch.replace(", ", "-")
            cmd = ["c++", "-std=c++17", "-O1", f"-I{SOURCE_DIR}", *BRANCHES[branch][1], str(source), "-o", str(exe)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            assert r.returncode == 0, f"{branch}: the program did not compile:\n{r.stderr[-3000:]}"
            built[branch] = str(exe)
        return built[branch]

    return program


def expected(k, q, p, v, lanes: int, bias: int):
    """The lanes of dot_i8(k, q) and dot_u7(p, v) over 64 bytes, exactly: lane j of a vector of
    `lanes` holds bytes 4j..4j+3 of every 4 * lanes bytes; dot_i8 adds bias * q."""
    def lane_sums(a, b):
        prod = a.astype(np.int64) * b.astype(np.int64)
        return prod.reshape(-1, 64 // (4 * lanes), lanes, 4).sum(axis=(1, 3))

    return lane_sums(k.astype(np.int64) + bias, q), lane_sums(p, v)


def run(program: str, k, q, p, v):
    cases = np.stack([k, q, p, v], axis=1).reshape(len(k), -1)
    text = f"{len(k)}\n" + "\n".join(" ".join(map(str, row)) for row in cases.tolist()) + "\n"
    r = subprocess.run([program], input=text, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    head, *rows = r.stdout.strip().splitlines()
    isa, bias, lanes = head.split()
    out = np.array([list(map(int, row.split())) for row in rows], dtype=np.int64).reshape(len(k), 2, int(lanes))
    return isa, int(bias), int(lanes), out[:, 0], out[:, 1]


def edge_cases():
    """The operands' extremes: k in [-128, 127], q in [-127, 127] (the query is quantized
    symmetrically), p in [0, 127], v in [-128, 127], each at its worst against the other."""
    k = np.array([[-128] * 64, [127] * 64, [-128] * 64, [0] * 64, [-128, 127] * 32, [127, -128] * 32], dtype=np.int64)
    q = np.array([[127] * 64, [-127] * 64, [-127] * 64, [-127] * 64, [-127, 127] * 32, [127, 127] * 32], dtype=np.int64)
    p = np.array([[127] * 64, [127] * 64, [0] * 64, [127, 0] * 32, [127] * 64, [1] * 64], dtype=np.int64)
    v = np.array([[-128] * 64, [127] * 64, [-128] * 64, [-128] * 64, [127, -128] * 32, [-128] * 64], dtype=np.int64)
    return k, q, p, v


@pytest.mark.parametrize("branch", list(BRANCHES))
def test_each_dot_product_branch_is_exact(programs, branch):
    """Every output lane of both dot products equals the integer sum, on the extremes and on
    random operands, and the program took the branch it was compiled for."""
    reason = _runnable(branch)
    if reason:
        pytest.skip(f"{branch}: {reason}")
    rng = np.random.default_rng(7)
    n = 500
    k = np.concatenate([edge_cases()[0], rng.integers(-128, 128, (n, 64))])
    q = np.concatenate([edge_cases()[1], rng.integers(-127, 128, (n, 64))])
    p = np.concatenate([edge_cases()[2], rng.integers(0, 128, (n, 64))])
    v = np.concatenate([edge_cases()[3], rng.integers(-128, 128, (n, 64))])
    isa, bias, lanes, i8, u7 = run(programs(branch), k, q, p, v)
    assert isa == BRANCHES[branch][0], f"compiled for {branch}, simd.h took {isa}"
    want_i8, want_u7 = expected(k, q, p, v, lanes, bias)
    bad = np.nonzero((i8 != want_i8).any(axis=1) | (u7 != want_u7).any(axis=1))[0]
    assert bad.size == 0, (f"{branch}: {bad.size} of {len(k)} cases differ, first {bad[0]}: "
                           f"dot_i8 {i8[bad[0]].tolist()} vs {want_i8[bad[0]].tolist()}, "
                           f"dot_u7 {u7[bad[0]].tolist()} vs {want_u7[bad[0]].tolist()}")


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_avx512_without_vnni_near_the_int16_limit(programs, data):
    """Skylake-SP's branch, emulated, where its pmaddubsw pair sums come closest to int16's
    limit: every byte's magnitude drawn from [lo, 127] (k and v reaching -128), signs per byte."""
    reason = _runnable("avx512bw-maddubs, emulated")
    if reason:
        pytest.skip(reason)
    lo = data.draw(st.integers(0, 127), label="smallest |byte|")
    n = 8
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    mag = rng.integers(lo, 128, (4, n, 64))
    sign = rng.choice([-1, 1], (4, n, 64))
    k = np.where(sign[0] < 0, -np.minimum(mag[0] + 1, 128), mag[0])  # k reaches -128
    q = sign[1] * mag[1]
    p = mag[2]
    v = np.where(sign[3] < 0, -np.minimum(mag[3] + 1, 128), mag[3])
    isa, bias, lanes, i8, u7 = run(programs("avx512bw-maddubs, emulated"), k, q, p, v)
    want_i8, want_u7 = expected(k, q, p, v, lanes, bias)
    assert (i8 == want_i8).all() and (u7 == want_u7).all()
