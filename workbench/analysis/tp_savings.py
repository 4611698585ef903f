"""Each of the paper's three tensor-parallel switches, and our KV handoff, its saving in bytes
and in ms, from the rows of one tensor-parallel ablation (workbench.analysis.tp_ablation).

switch_savings(rows): per (ranks, backend) and switch, the setting with the optimization (token ids,
the top-k LM head, zero copy, the KV handoff) against the one without it (embeddings, all logits
gathered, a copy, the shared KV head computed on both ranks), in rows matched on the other
switches:
    ranks, backend, switch, setting, against
    pairs                       matched pairs of rows (one per setting of the other switches)
    rounds                      paired differences the ms come from (pairs x rounds)
    sent_bytes_saved_per_token  communication payload saved per decode step (the rows' own
                                counts; zero copy sends the same)
    copied_bytes_saved_per_token  zero copy: the all-reduce payload not copied per step
    ms_saved_per_token          the paired rows' decode time apart, round by round, over every
                                pair and round: {median, min, max} (negative: the optimization
                                was slower); None where the rows carry no rounds
    pct_saved                   the median saving over the median time without it, in %
"""

from __future__ import annotations

import statistics


# Each switch and its setting without the optimization (the paper's three, and our KV handoff).
BASELINES = {"token_broadcast": "embeddings", "lm_head": "gather", "zero_copy": "off", "kv_handoff": "off"}


def switch_savings(rows: list[dict]) -> list[dict]:
    """Each switch's saving in bytes and in ms, with its spread (the module docstring)."""
    out = []
    multi = [r for r in rows if r["ranks"] > 1]
    def cluster(r):  # the rows of one cluster load: a mixture's expert split is a load of its own
        return r["ranks"], r["backend"], r.get("experts", "-")

    for ranks, backend, split in dict.fromkeys(map(cluster, multi)):
        group = [r for r in multi if cluster(r) == (ranks, backend, split)]
        for switch, baseline in BASELINES.items():
            others = [k for k in BASELINES if k != switch]
            # rows from before a switch existed do not name it
            for setting in dict.fromkeys(r.get(switch) for r in group if r.get(switch) not in (baseline, "n/a", None)):
                pairs = [(r, b) for r in group if r.get(switch) == setting for b in group
                         if b.get(switch) == baseline and all(b.get(k) == r.get(k) for k in others)]
                if not pairs:
                    continue
                saved = [b_ms - r_ms for r, b in pairs if "decode_ms_by_round" in r and "decode_ms_by_round" in b
                         for r_ms, b_ms in zip(r["decode_ms_by_round"], b["decode_ms_by_round"])]
                without = statistics.median(b["decode_ms_per_token"] for _, b in pairs)
                out.append({
                    "ranks": ranks, "backend": backend, **({"experts": split} if split != "-" else {}),
                    "switch": switch, "setting": setting, "against": baseline,
                    "pairs": len(pairs), "rounds": len(saved),
                    "sent_bytes_saved_per_token": statistics.median(
                        b["comm_bytes_per_token"] - r["comm_bytes_per_token"] for r, b in pairs),
                    "copied_bytes_saved_per_token": (statistics.median(r.get("allreduce_bytes_per_token", 0) for r, _ in pairs)
                                                     if switch == "zero_copy" else 0),
                    "ms_saved_per_token": ({"median": statistics.median(saved), "min": min(saved), "max": max(saved)}
                                           if saved else None),
                    "pct_saved": 100 * statistics.median(saved) / without if saved else None})
    return out


def savings_table(savings: list[dict]) -> list[dict]:
    """switch_savings' rows flat, for a table: the ms spread as three columns."""
    out = []
    for s in savings:
        ms = s["ms_saved_per_token"] or {}
        flat = {k: v for k, v in s.items() if k not in ("ms_saved_per_token", "pct_saved")}
        out.append(flat | {"ms_saved": ms.get("median"), "ms_saved_min": ms.get("min"), "ms_saved_max": ms.get("max"),
                           "pct_saved": s["pct_saved"]})
    return out
