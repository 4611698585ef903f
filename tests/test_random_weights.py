"""Random weights (kernels.random_normal, kernels/random.cpp): every value equal to a NumPy
re-computation of its definition (a hash of seed, stream and index; four 16-bit uniforms
summed, centred and scaled in float32), bf16 the float32 values rounded to nearest, the same
values on one thread and two, the moments of a normal with the asked std, and clear errors.
A random preset built from it is the same model every time and a different one per seed."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def mix64(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def reference(n: int, seed: int, stream: int, std: float) -> np.ndarray:
    key = mix64(np.uint64(seed) ^ mix64(np.uint64((stream + GOLDEN) & M64)))
    with np.errstate(over="ignore"):
        h = mix64(key + np.uint64(GOLDEN) * (np.arange(n, dtype=np.uint64) + np.uint64(1)))
    s = sum((h >> np.uint64(16 * j)) & np.uint64(0xFFFF) for j in range(4)).astype(np.float32)
    unit = ((s + np.float32(2)) * np.float32(1 / 65536) - np.float32(2)) * np.float32(math.sqrt(3))
    return unit * np.float32(std)


@given(n=st.integers(0, 3000), seed=st.integers(0, 2**63 - 1), stream=st.integers(0, 2**40),
       std=st.sampled_from([1.0, 0.02, 0.0]))
def test_values_are_the_definitions(kernels, n, seed, stream, std):
    out = kernels.random_normal((n,), seed=seed, stream=stream, std=std)
    assert out.dtype == torch.float32 and out.shape == (n,)
    np.testing.assert_array_equal(out.numpy(), reference(n, seed, stream, std))
    b = kernels.random_normal((n,), seed=seed, stream=stream, std=std, dtype=torch.bfloat16)
    assert torch.equal(b, out.to(torch.bfloat16))  # torch rounds float32 -> bf16 to nearest even


def test_the_same_values_on_any_thread_count_and_shape(kernels):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.random_normal((300, 1001), seed=7, stream=3, std=0.02)
        torch.set_num_threads(max(2, threads))
        two = kernels.random_normal((300_300,), seed=7, stream=3, std=0.02)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one.flatten(), two)


def test_moments_are_a_normals(kernels):
    n, std = 1 << 21, 0.02
    x = kernels.random_normal((n,), seed=1, stream=0, std=std).double()
    # mean within 5 standard errors; variance within 5 of its standard errors (fourth moment of
    # a normal: var(x^2) = 2 std^4); the four-uniform sum is bounded by 2 sqrt(3) std
    assert abs(x.mean()) < 5 * std / math.sqrt(n)
    assert abs(x.var() / std**2 - 1) < 5 * math.sqrt(2 / n)
    assert x.abs().max() <= 2 * math.sqrt(3) * std * (1 + 1e-6)
    other = kernels.random_normal((n,), seed=1, stream=1, std=std).double()
    assert abs(torch.corrcoef(torch.stack([x, other]))[0, 1]) < 5 / math.sqrt(n)  # streams independent


def test_bad_arguments_are_clear(kernels):
    with pytest.raises(ValueError, match="dtype must be torch.float32 or torch.bfloat16, got torch.float16"):
        kernels.random_normal((4,), seed=0, stream=0, dtype=torch.float16)
    with pytest.raises(ValueError, match="seed must be an integer >= 0, got -1"):
        kernels.random_normal((4,), seed=-1, stream=0)
    with pytest.raises(ValueError, match="seed must be below 2\\*\\*63"):
        kernels.random_normal((4,), seed=1 << 63, stream=0)
    with pytest.raises(ValueError, match="stream must be an integer >= 0, got 1.5"):
        kernels.random_normal((4,), seed=0, stream=1.5)
    with pytest.raises(ValueError, match="std must be a finite number >= 0, got nan"):
        kernels.random_normal((4,), seed=0, stream=0, std=float("nan"))


def test_a_random_preset_is_the_same_model_every_time_and_another_per_seed():
    import workbench as wb

    a, b = (wb.load_model("smollm2-135m", random=True, layers=1) for _ in range(2))
    c = wb.load_model("smollm2-135m", random=True, layers=1, seed=1)
    ids = list(range(1, 9))
    assert torch.equal(a.logits(ids), b.logits(ids))
    assert not torch.allclose(a.logits(ids), c.logits(ids))
    w = a.llama.layers[0].mlp_norm
    assert torch.equal(w, torch.ones_like(w))
