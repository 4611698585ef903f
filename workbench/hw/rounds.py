"""Interleaved rounds: the one way the workbench compares things by timing them.

Every round runs each case once, in a new random order, so a slow spell of the machine (a
neighbour's burst, a frequency change, the page cache) lands on every case alike instead of
on whichever ran during it; warm-up rounds come first, in the given order, and are not kept.
Callers time each call and keep what they measure (seconds, a generation's record):

    for round_, name in interleaved_rounds(cases, repeats=5):
        t0 = time.perf_counter(); cases[name](); dt = time.perf_counter() - t0
        if round_ >= 0:
            samples[name].append(dt)
"""

from __future__ import annotations

import random
import statistics
from typing import Hashable, Iterable, Iterator


def interleaved_rounds(cases: Iterable[Hashable], repeats: int, *, warmup: int = 0,
                       seed: int = 0) -> Iterator[tuple[int, Hashable]]:
    """(round, case) pairs: `warmup` rounds numbered -warmup..-1 in the given order, then
    rounds 0..repeats-1, each case once per round in a new random order (seeded)."""
    names = list(cases)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 0:
        raise ValueError(f"repeats must be a non-negative integer, got {repeats!r}")
    order = random.Random(seed)
    for round_ in range(-warmup, repeats):
        for name in names if round_ < 0 else order.sample(names, len(names)):
            yield round_, name


def ratio_of_runs(num: list[float], den: list[float]) -> dict:
    """median(num) / median(den) of samples taken apart, with the worst and best pairing of
    them as {median, min, max}."""
    return {"median": statistics.median(num) / statistics.median(den), "min": min(num) / max(den),
            "max": max(num) / min(den)}


def ratio_by_round(num: dict[int, float], den: dict[int, float]) -> dict:
    """num / den within each round both ran in, as {median, min, max} over those rounds."""
    ratios = [num[r] / den[r] for r in num if r in den]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
