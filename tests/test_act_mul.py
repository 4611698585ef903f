"""The MLP activation kernel of prefill (kernels.act_mul: SiLU(gate) * up, or GELU's tanh form
times up, over each [gate | up] row) against a float64 reference, on every ISA build: odd widths
(vector tails), one row and many (rows in parallel), large |gate| where exp over- or
underflows, and clear errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

# Also on the "emulated" build (conftest.py): the AVX-512 path, VNNI included, on any AVX2 host.
ALSO_EMULATED = True


@given(T=st.integers(1, 70), F=st.integers(1, 300), scale=st.sampled_from([1.0, 30.0]), seed=st.integers(0, 1000),
       activation=st.sampled_from(["silu", "gelu_tanh"]))
def test_act_mul_matches_reference(kernels, T, F, scale, seed, activation):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(T, 2 * F, generator=gen) * scale
    out = kernels.act_mul(gate_up, activation)
    g, u = gate_up.double().split([F, F], dim=-1)
    if activation == "silu":
        ref = g * torch.sigmoid(g) * u
    else:
        ref = torch.nn.functional.gelu(g, approximate="tanh") * u
    assert out.shape == (T, F) and out.dtype == torch.float32
    # the vector exp is good to ~1e-7 relative; fp32 rounding of g / (1 + e) and the product
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=2e-6)


def test_act_mul_rejects_bad_input(kernels):
    with pytest.raises(ValueError, match="even number of columns"):
        kernels.act_mul(torch.zeros(3, 5))
    with pytest.raises(TypeError, match="gate_up must be float32"):
        kernels.act_mul(torch.zeros(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"gate_up must be 2-D \[T, 2F\]|\[T, 2F\]"):
        kernels.act_mul(torch.zeros(4))
    with pytest.raises(ValueError, match="activation must be 'silu' or 'gelu_tanh', got 'relu'"):
        kernels.act_mul(torch.zeros(2, 4), "relu")
    assert kernels.act_mul(torch.zeros(0, 8)).shape == (0, 4)
