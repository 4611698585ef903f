"""How a model is split over R ranks (Megatron-style tensor parallelism, the paper's 2.3):

    attention   by KV-head groups: rank r keeps a contiguous run of KV heads, the query
                heads that share them, and (so) their share of the KV cache; wq / wk / wv
                rows, wo columns
    MLP         gate / up rows (the FFN's columns), down columns; where the attention split is
                uneven, the FFN split leans the other way so every rank holds the same
                weight bytes per layer (in steps of FFN_ALIGN features): a decode step
                reads each rank's weights once, and the ranks meet at every all-reduce, so
                the rank with the most bytes sets the pace
    after       o_proj and down_proj give partial sums on every rank: an all-reduce follows
                (workbench.distributed.tp)
    norms       replicated
    embedding   replicated (every rank embeds the broadcast token ids itself)
    LM head     by vocabulary rows (each rank scores its slice: local top-k, then a gather);
                the "hidden-split" variant keeps columns of the hidden size instead

Splits may be uneven: the bundled model's 3 KV heads over 2 ranks are 2 + 1 (and its 9
query heads 6 + 3), so its 1536 FFN features go 704 + 832. More ranks than KV heads is
refused: a rank would have no attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.model.config import ModelConfig


def split(n: int, parts: int, index: int) -> tuple[int, int]:
    """[lo, hi) of the index-th of `parts` nearly equal contiguous pieces of range(n); the
    first n % parts pieces are one longer."""
    base, extra = divmod(n, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


FFN_ALIGN = 64  # FFN features per step of the balanced split: whole int8-g32 groups and cache lines


def balanced_ffn_split(cfg: ModelConfig, world: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of the FFN features rank keeps: as many as make its attention and MLP weights
    together 1/world of a layer's (each feature is a gate row, an up row and a down column:
    3 x dim weights), in multiples of FFN_ALIGN, at least one step each; an even split where
    the attention split is even."""
    hd, dim, group = cfg.head_dim, cfg.dim, cfg.n_heads // cfg.n_kv_heads

    def attention(r: int) -> int:  # wq, wk, wv rows and wo columns of rank r
        lo, hi = split(cfg.n_kv_heads, world, r)
        return 2 * (hi - lo) * (group + 1) * hd * dim

    if len({attention(r) for r in range(world)}) == 1 or cfg.ffn_dim < world * FFN_ALIGN:
        return split(cfg.ffn_dim, world, rank)
    share = (sum(attention(r) for r in range(world)) + 3 * dim * cfg.ffn_dim) / world
    bounds, want = [0], 0.0
    for r in range(world - 1):  # each boundary at its cumulative target, rounded to a step
        want += (share - attention(r)) / (3 * dim)
        lowest, highest = bounds[-1] + FFN_ALIGN, cfg.ffn_dim - FFN_ALIGN * (world - 1 - r)
        bounds.append(min(max(FFN_ALIGN * round(want / FFN_ALIGN), lowest), highest))
    bounds.append(cfg.ffn_dim)
    return bounds[rank], bounds[rank + 1]


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    world: int
    kv_heads: tuple[int, int]  # [lo, hi) of the KV heads this rank keeps
    q_heads: tuple[int, int]  # the query heads that share them
    ffn: tuple[int, int]  # [lo, hi) of the FFN's intermediate features
    vocab: tuple[int, int]  # [lo, hi) of the vocabulary (LM head rows)
    hidden: tuple[int, int]  # [lo, hi) of the hidden size (the hidden-split LM head's columns)


def plan(cfg: ModelConfig, rank: int, world: int) -> ShardPlan:
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"ranks must be a positive integer, got {world!r}")
    if world > cfg.n_kv_heads:
        raise ValueError(f"{cfg.name} has {cfg.n_kv_heads} KV heads, so at most {cfg.n_kv_heads} tensor-parallel "
                         f"ranks (each keeps at least one KV head with its query heads); got {world}")
    group = cfg.n_heads // cfg.n_kv_heads
    kv = split(cfg.n_kv_heads, world, rank)
    return ShardPlan(rank, world, kv, (kv[0] * group, kv[1] * group), balanced_ffn_split(cfg, world, rank),
                     split(cfg.vocab_size, world, rank), split(cfg.dim, world, rank))


def shard_hook(rank: int, world: int):
    """A workbench.model.llama.ShardHook keeping rank's slices (see the module docstring).
    Slices are copied (contiguous), so the full matrices can be freed as loading goes."""
    def keep(cfg: ModelConfig, layer, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        p = plan(cfg, rank, world)
        hd = cfg.head_dim
        q = slice(p.q_heads[0] * hd, p.q_heads[1] * hd)
        kv = slice(p.kv_heads[0] * hd, p.kv_heads[1] * hd)
        ffn = slice(*p.ffn)
        if layer is None:  # embedding (replicated), final norm, LM head by vocabulary
            head = w["lm_head"]
            return {"embedding": w["embedding"], "final_norm": w["final_norm"],
                    "lm_head": head[slice(*p.vocab)].contiguous(),
                    "lm_head_hidden_split": head[:, slice(*p.hidden)].contiguous()}
        return {"attn_norm": w["attn_norm"], "mlp_norm": w["mlp_norm"],
                "wq": w["wq"][q].contiguous(), "wk": w["wk"][kv].contiguous(), "wv": w["wv"][kv].contiguous(),
                "wo": w["wo"][:, q].contiguous(),
                "w_gate": w["w_gate"][ffn].contiguous(), "w_up": w["w_up"][ffn].contiguous(),
                "w_down": w["w_down"][:, ffn].contiguous()}

    return keep
