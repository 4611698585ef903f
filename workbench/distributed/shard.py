"""How a model is split over R ranks (Megatron-style tensor parallelism, the paper's 2.3):

    attention   by KV-head groups where the ranks divide the KV heads: rank r keeps a
                contiguous run of KV heads, the query heads that share them, and (so) their
                share of the KV cache. Otherwise, where it leaves the busiest rank fewer
                weights, by query heads: rank r keeps an equal run of query heads and every
                KV head they read, so a KV head whose group the split cuts is kept (its wk /
                wv rows and its cache) on both ranks, and the groups on a rank are uneven
                (ShardPlan.head_map tells the kernels which KV head each query head reads).
                wq / wk / wv rows, wo columns
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
finishes its part early waits at the all-reduce. Hence the query-head split where the KV heads
do not divide (the bundled model's 3 KV heads over 2 ranks: by KV heads 2 + 1, rank 0 holding
twice rank 1's attention weights; by query heads 5 + 4 of the 9, with KV heads 0-1 and 1-2,
14 : 12 in units of head_dim x dim), and an even FFN split whatever the attention split
(leaning it against an uneven attention split would equalize a rank's bytes per layer and
unbalance the MLP part as well). More ranks than KV heads is refused.

A KV head that two ranks hold is computed once where the collective can hand it over
one-sided (shm; ShardPlan.kv_handoff, kernels/decode_step.cpp): the later rank computes its k
and v first thing in the layer and hands them over, the earlier one (which has the extra
query head) skips those rows and takes them. The bundled model's split is then 12 : 12, and
both ranks still hold the head's weights (the Python path and the other backends compute it
on both).
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
    # Query heads of the first KV head's group held by an earlier rank (the query-head split
    # only, else 0), and the model's query heads per KV head: query head h of this rank reads
    # its KV head (h + q_offset) // group.
    q_offset: int = 0
    group: int = 1

    @property
    def kv_handoff(self) -> tuple[bool, bool]:
        """(send, recv): whether this rank's first KV head is also the previous rank's last (its
        group starts there), and whether its last is also the next rank's first (its group goes
        on there). The fused step computes such a head once: the later rank computes its k and
        v and hands them to the earlier, which has the extra query head of the split."""
        return self.q_offset > 0, self.q_heads[1] < self.kv_heads[1] * self.group

    @property
    def head_map(self) -> tuple[int, int] | None:
        """(group, q_offset) for the kernels where this rank's groups are uneven, else None."""
        q, kv = self.q_heads[1] - self.q_heads[0], self.kv_heads[1] - self.kv_heads[0]
        return (self.group, self.q_offset) if self.q_offset or q != self.group * kv else None


def attention_split(cfg: ModelConfig, world: int, rank: int) -> tuple[tuple[int, int], tuple[int, int], int]:
    """(query heads, KV heads, q_offset) of rank: by KV heads with their whole groups where the
    ranks divide the KV heads; otherwise whichever of that and the query-head split gives the
    busiest rank the fewer attention weights. The query-head split gives each rank an equal
    share of the query heads and every KV head any of them reads, so a KV head whose group
    the split cuts is held (its wk and wv rows, its cache) by both ranks."""
    group = cfg.n_heads // cfg.n_kv_heads

    def by_kv(r):
        kv = split(cfg.n_kv_heads, world, r)
        return (kv[0] * group, kv[1] * group), kv, 0

    def by_q(r):
        q = split(cfg.n_heads, world, r)
        kv = (q[0] // group, -(-q[1] // group))
        return q, kv, q[0] - kv[0] * group

    if cfg.n_kv_heads % world == 0:
        return by_kv(rank)

    def busiest(how):  # wq and wo: 2 x hd x dim per query head; wk and wv: the same per KV head
        return max(2 * (q[1] - q[0]) + 2 * (kv[1] - kv[0]) for q, kv, _ in map(how, range(world)))

    return (by_q if busiest(by_q) < busiest(by_kv) else by_kv)(rank)


def plan(cfg: ModelConfig, rank: int, world: int) -> ShardPlan:
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"ranks must be a positive integer, got {world!r}")
    if world > cfg.n_kv_heads:
        raise ValueError(f"{cfg.name} has {cfg.n_kv_heads} KV heads, so at most {cfg.n_kv_heads} tensor-parallel "
                         f"ranks (each keeps at least one KV head with its query heads); got {world}")
    q, kv, q_offset = attention_split(cfg, world, rank)
    return ShardPlan(rank, world, kv, q, ffn_split(cfg, world, rank), split(cfg.vocab_size, world, rank),
                     split(cfg.dim, world, rank), q_offset, cfg.n_heads // cfg.n_kv_heads)


def shares_kv_head(cfg: ModelConfig, world: int) -> bool:
    """Whether the split over `world` ranks leaves some KV head on two ranks (ShardPlan.kv_handoff)."""
    return 1 < world <= cfg.n_kv_heads and any(plan(cfg, r, world).kv_handoff[1] for r in range(world))


def take(p: ShardPlan, head_dim: int, layer: int | None, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The slices of one layer's unfused weights (layer None: the embedding, final norm and LM
    head dict) that the rank of plan p keeps (see the module docstring). Slices are copied
    (contiguous), so the full matrices can be freed as loading goes."""
    q = slice(p.q_heads[0] * head_dim, p.q_heads[1] * head_dim)
    kv = slice(p.kv_heads[0] * head_dim, p.kv_heads[1] * head_dim)
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
