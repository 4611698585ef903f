"""Plotly axes shared by the figures: a log axis labelled at its decades.

    layout["xaxis"] = decade_axis("FLOPs per byte read", xs)

Plotly's own labels on a log axis spanning a decade or two name the multiples in between by
their first digit ("2 3 4 ... 9 1 2", "5 1 2 5 10"), so a point at 0.5 reads as "5"; over more
decades it uses SI prefixes ("1m" is 0.001). Here every power of ten the values span is a
tick labelled in full (0.01, 0.1, 1, 10, ...; 10⁻⁵ and 10⁵ beyond), with unlabelled minor
ticks and grid lines between them.
"""

from __future__ import annotations

import math

SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def decade_label(k: int) -> str:
    """10**k in full where that is short (0.001 to 10000), else as a power."""
    if -3 <= k < 0:
        return f"{10.0 ** k:.{-k}f}"
    if 0 <= k <= 4:
        return str(10 ** k)
    return "10" + str(k).translate(SUPERSCRIPT)


def decade_axis(title: str, values, **extra) -> dict:
    """A log axis from the decade below the smallest positive value to the one above the
    largest, a labelled tick at each power of ten. ValueError without a positive value."""
    positive = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not positive:
        raise ValueError(f"a log axis ({title}) needs a positive value")
    lo, hi = math.floor(math.log10(min(positive))), math.ceil(math.log10(max(positive)))
    hi = max(hi, lo + 1)
    decades = range(lo, hi + 1)
    return {"type": "log", "title": {"text": title}, "range": [lo, hi],
            "tickmode": "array", "tickvals": [10.0 ** k for k in decades], "ticktext": [decade_label(k) for k in decades],
            "minor": {"ticks": "outside", "ticklen": 3, "showgrid": True, "gridcolor": "rgba(0, 0, 0, 0.04)"},
            **extra}
