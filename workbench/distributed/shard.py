"""How a model is split over R ranks (Megatron-style tensor parallelism, the paper's 2.3):

    attention   by KV-head groups: rank r keeps a contiguous run of KV heads, the query
                heads that share them, and (so) their share of the KV cache; wq / wk / wv
                rows, wo columns
    MLP         gate / up rows (the FFN's columns), down columns, split evenly in steps of
                FFN_ALIGN features
    after       o_proj and down_proj give partial sums on every rank: an all-reduce follows
                (workbench.distributed.tp)
    norms       replicated
    embedding   replicated (every rank embeds the broadcast token ids itself)
    LM head     by vocabulary rows (each rank scores its slice: local top-k, then a gather);
                the "hidden-split" variant keeps columns of the hidden size instead

The ranks meet at both all-reduces of every layer, so each of the two parts between them (the
attention block, the MLP block) should take every rank the same time on its own: a rank that
finishes its part early waits at the all-reduce. The FFN is therefore split evenly even where
the attention split is not (leaning the FFN against it would equalize a rank's bytes per layer
and unbalance the MLP part as well). The attention split is uneven when the ranks do not divide
the KV heads: the bundled model's 3 KV heads over 2 ranks are 2 + 1 (and its 9 query heads
6 + 3), so in its attention part rank 1 waits for rank 0. More ranks than KV heads is refused: a
rank would have no attention.
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


FFN_ALIGN = 64  # FFN features per step of the split: whole int8-g32 groups and cache lines


def ffn_split(cfg: ModelConfig, world: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of the FFN features rank keeps: whole FFN_ALIGN steps split as evenly as
    split() splits them (the last rank also takes the features past the last whole step);
    a plain even split where there are fewer steps than ranks."""
    steps = cfg.ffn_dim // FFN_ALIGN
    if steps < world:
        return split(cfg.ffn_dim, world, rank)
    lo, hi = split(steps, world, rank)
    return lo * FFN_ALIGN, cfg.ffn_dim if rank == world - 1 else hi * FFN_ALIGN


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
    return ShardPlan(rank, world, kv, (kv[0] * group, kv[1] * group), ffn_split(cfg, world, rank),
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
