"""How many threads the kernels and torch use: one rule, used by Model.threads, %threads,
the CLI's --threads and the panel."""

from __future__ import annotations

import os

import torch

# More threads than this many per logical CPU is surely a typo, not an experiment.
MAX_OVERSUBSCRIPTION = 4


def set_threads(n) -> int:
    """torch.set_num_threads(n) after checking n; returns n. Our kernels run on torch's
    intra-op pool, so this governs them too."""
    cpus = os.cpu_count() or 1
    most = MAX_OVERSUBSCRIPTION * cpus
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= most:
        raise ValueError(f"threads must be between 1 and {most} on this machine ({cpus} CPUs, at most "
                         f"{MAX_OVERSUBSCRIPTION} threads per CPU), got {n!r}")
    torch.set_num_threads(n)
    return n


def get_threads() -> int:
    return torch.get_num_threads()
