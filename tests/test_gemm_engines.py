"""The GEMM's micro-kernels for bf16 and int8 weights, chosen at run time (kernels/gemm_bf16.cpp): each
engine this host may run, on every ISA build, against a float64 reference over shapes that
cover every edge of the tiling (tokens not whole tiles or 256-token blocks, rows of w not
whole 32-row blocks or 128-row tasks, K not whole 32-value tiles or slices of K, odd K
across slices).

The AMX and AVX512-BF16 engines round x to bf16 (round to nearest even) and accumulate in
fp32, so their reference is x rounded the same way times the weights as the engine sees them
(bf16; int8 values; grouped int8 times its scale rounded to bf16) in float64; the FMA engine
keeps x in fp32. Either way only fp32 accumulation differs from the reference: 1e-4 relative to
sqrt(K) max|x| max|w|, as in test_linear.py. The "amx_int8" engine runs per-row int8 weights
as W8A8: x quantized per token as the kernel does it (in fp32: 127 / max|x| times x, rounded to
nearest even), int32 sums that are exact, then two fp32 scalings, so its reference holds to
1e-6 relative, element by element. Where the CPU, the OS or the kernel refuses the tiles,
asking for them is a clear error and the engine in force stays.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference import int8_weights_reference

# Also on the "emulated" build (conftest.py): the AMX and AVX512-BF16 engines' own code, their
# instructions in C++, checked here on every host, not only where the CPU has them.
ALSO_EMULATED = True


def w8a8_reference(x: torch.Tensor, q: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """The amx_int8 engine's product for per-row int8 weights in float64: x quantized per
    token in fp32 exactly as the kernel quantizes it, the sums exact, then both scales."""
    amax = x.abs().amax(dim=1)
    # a tensor over a tensor: one IEEE division, as the kernel's (127 / t is 127 * (1 / t) in torch)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    qx = (x * inv[:, None]).round()  # fp32 product, half to even: the kernel's cvtps2dq
    assert qx.abs().max() <= 127
    return (qx.double() @ q.double().t()) * (amax / 127).double()[:, None] * row_scale.double()[None, :]


def runnable(kernels) -> list[str]:
    return [name for name, (ok, _) in kernels.gemm_engines().items() if ok]


@pytest.fixture
def engines(kernels):
    """The engines this build may run here; the build's choice is restored afterwards."""
    yield runnable(kernels)
    kernels.set_gemm_engine("auto")


@given(
    M=st.one_of(st.integers(1, 40), st.sampled_from([255, 256, 257, 272, 530])),
    N=st.one_of(st.integers(1, 70), st.sampled_from([127, 128, 129, 300, 576])),  # 576: tasks of 96 rows
    K=st.sampled_from([1, 7, 31, 32, 33, 64, 129, 531, 576, 1000, 1025, 1100]),
    seed=st.integers(0, 1000),
)
def test_every_engine_matches_reference(kernels, M, N, K, seed):
    engines = runnable(kernels)
    try:
        check_engines(kernels, engines, M, N, K, seed)
    finally:
        kernels.set_gemm_engine("auto")


def check_engines(kernels, engines, M, N, K, seed):
    """bf16, per-row int8 and grouped int8 weights on each engine against float64. On a bf16
    engine x is rounded to bf16; per-row int8 values are exact in bf16 (the row scale applies to
    the outputs), grouped int8 values are rounded to bf16 after their scale, as the kernel does."""
    from workbench.kernels import quantize_weight_int8

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen)
    w32 = torch.randn(N, K, generator=gen)
    q, row_scale = quantize_weight_int8(w32)
    qg, group_scale = quantize_weight_int8(w32, 32)
    grouped = int8_weights_reference(qg, group_scale)
    for engine in engines:
        kernels.set_gemm_engine(engine)
        assert kernels.gemm_engine() == engine
        bf16 = engine != "fma"
        xr = (x.bfloat16() if bf16 else x).double()
        cases = {"bf16": (w32.bfloat16(), None, w32.bfloat16().double(), None),
                 "int8": (q, row_scale, q.double(), row_scale.double()),
                 "int8-g32": (qg, group_scale, (grouped.bfloat16() if bf16 else grouped).double(), None)}
        for name, (w, scale, w_ref, out_scale) in cases.items():
            y = kernels.linear(x, w, scale=scale, matvec_max_rows=0)  # the GEMM, whatever M
            if engine == "amx_int8" and name == "int8":  # W8A8 (the other formats: as amx_bf16)
                torch.testing.assert_close(y.double(), w8a8_reference(x, q, row_scale), atol=0, rtol=1e-6,
                                           msg=lambda m: f"amx_int8, int8 weights (W8A8): {m}")
                continue
            ref = xr @ w_ref.t()
            if out_scale is not None:
                ref = ref * out_scale
            bound = K**0.5 * x.abs().max().item() * (w_ref.abs().max().item() * (1 if out_scale is None else
                                                                                  out_scale.max().item()))
            assert y.dtype == torch.float32 and y.shape == (M, N)
            torch.testing.assert_close(y.double(), ref, atol=1e-4 * bound + 1e-6, rtol=0,
                                       msg=lambda m: f"{engine}, {name} weights: {m}")


@pytest.mark.parametrize("M,N,K", [(1030, 600, 40), (520, 1024, 33)])
def test_outputs_large_enough_to_stream(kernels, engines, M, N, K):
    """Outputs of 2 MiB and more are written with non-temporal stores where a whole aligned
    64-byte piece allows (rows of 600 floats alternate in alignment), masked stores elsewhere."""
    check_engines(kernels, engines, M, N, K, seed=M)


@pytest.mark.parametrize("M,N,K", [(40, 70, 2047), (33, 129, 2049), (5, 40, 4200)])
def test_w8a8_sums_across_slices_of_k(kernels, engines, M, N, K):
    """W8A8 cuts K into slices of 2048 int8 values (the bytes of a bf16 slice), its int32 sums
    carried across them in the task's buffer: exact there too, and with a weight of -128."""
    if "amx_int8" not in engines:
        pytest.skip(f"amx_int8 may not run here: {kernels.gemm_engines()['amx_int8'][1]}")
    from workbench.kernels import quantize_weight_int8

    gen = torch.Generator().manual_seed(K)
    x = torch.randn(M, K, generator=gen)
    q, row_scale = quantize_weight_int8(torch.randn(N, K, generator=gen))
    q[0, :64] = -128
    kernels.set_gemm_engine("amx_int8")
    torch.testing.assert_close(kernels.linear(x, q, scale=row_scale, matvec_max_rows=0).double(),
                               w8a8_reference(x, q, row_scale), atol=0, rtol=1e-6)


def test_w8a8_gives_a_token_that_is_not_finite_outputs_that_are_not(kernels, engines):
    """A token with an inf or a NaN has no int8 scale: its outputs come out inf or NaN (as on
    the bf16 engines), never finite numbers from a clamped quantization; a token too small for
    any scale gives zeros; and the other tokens' outputs are unaffected."""
    if "amx_int8" not in engines:
        pytest.skip(f"amx_int8 may not run here: {kernels.gemm_engines()['amx_int8'][1]}")
    from workbench.kernels import quantize_weight_int8

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(20, 100, generator=gen)
    x[3, 7], x[5, 1] = float("inf"), float("nan")
    x[8] *= 1e-38  # so small that 127 / max|x| overflows: counted as zeros, its outputs 0
    q, row_scale = quantize_weight_int8(torch.randn(40, 100, generator=gen))
    kernels.set_gemm_engine("amx_int8")
    y = kernels.linear(x, q, scale=row_scale, matvec_max_rows=0)
    assert not y[3].isfinite().any() and not y[5].isfinite().any()
    assert (y[8] == 0).all()
    keep = [m for m in range(20) if m not in (3, 5, 8)]
    torch.testing.assert_close(y[keep].double(), w8a8_reference(x[keep], q, row_scale), atol=0, rtol=1e-6)


def test_the_engines_say_why(kernels, engines):
    status = kernels.gemm_engines()
    assert set(status) == {"fma", "amx_bf16", "avx512_bf16", "amx_int8"} and status["fma"][0]
    assert all(isinstance(why, str) and why for _, why in status.values())
    with pytest.raises(ValueError, match=r"engine must be one of auto, fma, amx_bf16, avx512_bf16, amx_int8, got 'tiles'"):
        kernels.set_gemm_engine("tiles")
    with pytest.raises(ValueError, match=r"set_gemm_engine: engine must be .* or 'amx_int8', got 'tiles'"):
        kernels.ext.set_gemm_engine("tiles")
    for name in ("amx_bf16", "avx512_bf16", "amx_int8"):
        if name not in engines:
            before = kernels.gemm_engine()
            with pytest.raises(RuntimeError, match=f"{name} cannot run here: " + status[name][1][:20]):
                kernels.set_gemm_engine(name)
            assert kernels.gemm_engine() == before


def test_auto_picks_the_matrix_engine_only_where_the_build_targets_avx512(kernels, engines):
    """The native build on an AMX host runs the tiles; an AVX2 or scalar build (standing in for
    the CPUs it targets) stays on FMAs unless asked, though it carries the AMX code too."""
    kernels.set_gemm_engine("auto")
    expect = "fma"
    if kernels.isa == "avx512":
        expect = next((e for e in ("amx_bf16", "avx512_bf16") if e in engines), "fma")
    assert kernels.gemm_engine() == expect


def test_fp32_weights_keep_the_fma_engine_and_the_rest_follow_the_engine(kernels, engines):
    """fp32 weights stay exact in fp32 on every engine; bf16 and int8 weights run on the engine in
    force (gemm_engine_for says so, and --info lists it per weight kernel), except that under
    amx_int8 only per-row int8 weights run W8A8 and the rest run on the bf16 tiles."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(40, 96, generator=gen), torch.randn(50, 96, generator=gen)
    for engine in engines:
        kernels.set_gemm_engine(engine)
        torch.testing.assert_close(kernels.linear(x, w, matvec_max_rows=0).double(), x.double() @ w.double().t(),
                                   atol=1e-4, rtol=1e-5)
        assert kernels.gemm_engine_for("float32") == "fma"
        expect = {"bfloat16": engine, "int8": engine, "int8_group": engine}
        if engine == "amx_int8":
            expect.update(bfloat16="amx_bf16", int8_group="amx_bf16")
        assert {k: kernels.gemm_engine_for(k) for k in expect} == expect
    with pytest.raises(ValueError, match="gemm_engine_for: kernel must be one of 'float32', 'bfloat16', 'int8', 'int8_group', 'q4_0', .*'q6_k', 'i4_g128', got 'q4'"):
        kernels.gemm_engine_for("q4")


MODEL_ON_ENGINES = r"""
import json, sys
from pathlib import Path
import workbench as wb
from workbench import kernels
fp32, bf16 = wb.load_model("smollm2-135m"), wb.load_model("smollm2-135m", dtype="bf16")
ids = fp32.tokenizer.encode(Path("/usr/share/common-licenses/Apache-2.0").read_text()[:1500])[:64]
ref = fp32.logits(ids).double()
# prompts longer than the matrix-vector kernel's rows, so their prefill (and the first token)
# runs on the engine
prompts = ("The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "Once upon a time, in a small village at the edge of a great forest, there lived a")
shortest = min(len(fp32.tokenizer.encode(p)) for p in prompts)
greedy = {p: fp32.generate(p, max_new_tokens=3, stop_at_eos=False).token_ids for p in prompts}
out = {"build": kernels.native.variant, "shortest_prompt": shortest, "matvec_rows": kernels.matvec_max_rows("bfloat16")}
for engine in ["fma"] + sys.argv[1:]:
    kernels.set_gemm_engine(engine)
    logits = bf16.logits(ids).double()
    out[engine] = {"attention": str(bf16.llama.attention_dtype),
                   "rel_err": ((logits - ref).norm(dim=-1) / ref.norm(dim=-1)).median().item(),
                   "top1": (logits.argmax(-1) == ref.argmax(-1)).float().mean().item(),
                   "same_greedy": [bf16.generate(p, max_new_tokens=3, stop_at_eos=False).token_ids == greedy[p]
                                   for p in prompts]}
print(json.dumps(out))
"""


def test_the_model_on_each_bf16_engine_tracks_fp32(kernels):
    """The bundled model with bf16 weights, prefilled on each bf16 engine this build runs (real
    AMX / AVX512-BF16 where the CPU has them, their code in C++ on the emulated build), in a
    process whose whole workbench runs this build ($WORKBENCH_KERNELS_BUILD): the GEMMs take x
    in bf16 and attention runs on tiles, and the model still predicts as the fp32 model does.
    Greedy tokens equal on three prompts (their prefill on the engine; the decode steps after
    the first token run the matrix-vector kernel) and top-1 agreement >= 0.9 over 64 tokens of
    real text (as test_runtime's bf16 weights on FMAs). The logits' median relative error is held to 3x
    that of bf16 weights on FMAs, which round only the weights: the engines round x to the same
    8 bits (each product sees two rounded operands, not one: sqrt(2)) and attention rounds q,
    k, v and P as well, the same size of rounding again, so the same order of error; a wrong
    tile or pair would be tens of times off."""
    import json
    import os
    import subprocess
    import sys

    engines = [e for e in runnable(kernels) if e not in ("fma", "amx_int8")]  # amx_int8: bf16 weights as amx_bf16
    if not engines:
        pytest.skip(f"no bf16 engine runs on the {kernels.variant} build here: {kernels.gemm_engines()['amx_bf16'][1]}")
    env = {**os.environ, "WORKBENCH_KERNELS_BUILD": kernels.variant}
    done = subprocess.run([sys.executable, "-c", MODEL_ON_ENGINES, *engines], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["build"] == kernels.variant
    assert out["shortest_prompt"] > out["matvec_rows"]  # the prompts' prefill ran on the GEMM
    weights_only = out["fma"]["rel_err"]
    assert out["fma"]["attention"] == "torch.float32"
    for engine in engines:
        r = out[engine]
        assert r["attention"] == "torch.bfloat16", (engine, r)
        assert all(r["same_greedy"]) and r["top1"] >= 0.9, (engine, r)
        assert r["rel_err"] <= 3 * weights_only, (engine, r["rel_err"], weights_only)


W8A8_MODEL = r"""
import json
from pathlib import Path
import workbench as wb
from workbench import kernels
fp32, int8 = wb.load_model("smollm2-135m"), wb.load_model("smollm2-135m", dtype="int8")
ids = fp32.tokenizer.encode(Path("/usr/share/common-licenses/Apache-2.0").read_text()[:1500])[:64]
ref = fp32.logits(ids).double().log_softmax(-1)
out = {"build": kernels.native.variant, "matvec_rows": kernels.matvec_max_rows("int8"), "tokens": len(ids)}
for engine in ("amx_bf16", "amx_int8"):
    kernels.set_gemm_engine(engine)
    got = int8.logits(ids).double().log_softmax(-1)
    out[engine] = {"for_int8": kernels.gemm_engine_for("int8"),
                   "kl_nats": (ref.exp() * (ref - got)).sum(-1).mean().item(),
                   "top1": (got.argmax(-1) == ref.argmax(-1)).double().mean().item()}
print(json.dumps(out))
"""


def test_w8a8_runs_the_int8_models_prefill_and_predicts_near_fp32(kernels):
    """The bundled model with int8 weights, its 64-token prefill on amx_int8 (a user's
    set_gemm_engine("amx_int8"), on the whole workbench of this build): the int8 linears run
    W8A8, so their quantized activations move the predictions further from fp32's than the
    same weights on the bf16 tiles do (the path ran), yet the model still predicts like it:
    top-1 agreement >= 0.8 and mean KL < 0.3 nats, where the emulated build measured 0.91 and
    0.09 (and 0.89 / 0.046 over 1024 tokens, docs/runtime-and-kernels.md); a wrong tile, quad or
    scale puts the KL in whole nats. The kernel itself is held to 1e-6 above."""
    import json
    import os
    import subprocess
    import sys

    if not kernels.gemm_engines()["amx_int8"][0]:
        pytest.skip(f"amx_int8 may not run on the {kernels.variant} build here: {kernels.gemm_engines()['amx_int8'][1]}")
    env = {**os.environ, "WORKBENCH_KERNELS_BUILD": kernels.variant}
    done = subprocess.run([sys.executable, "-c", W8A8_MODEL], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["build"] == kernels.variant and out["tokens"] > out["matvec_rows"]  # the prefill ran on the GEMM
    w8a8, tiles = out["amx_int8"], out["amx_bf16"]
    assert (w8a8["for_int8"], tiles["for_int8"]) == ("amx_int8", "amx_bf16")
    assert w8a8["kl_nats"] > tiles["kl_nats"], out
    assert w8a8["top1"] >= 0.8 and w8a8["kl_nats"] < 0.3, out
