import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from workbench.kernels import KernelSet, runnable_variants

# Hypothesis: no per-example deadline (the scalar build and the float64 references are
# slow by design); the example count is a profile so CI and a developer can differ.
settings.register_profile(
    "default",
    max_examples=int(os.environ.get("WORKBENCH_HYPOTHESIS_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("default")


@pytest.fixture(scope="session", params=runnable_variants())
def kernels(request) -> KernelSet:
    """The kernel API on every build this host can execute: native, avx2, scalar."""
    ks = KernelSet(request.param)
    ks.ext  # build now, outside any hypothesis example
    return ks


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
