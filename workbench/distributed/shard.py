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
                FFN_ALIGN features, or of down's blocks where they are longer (a K-quant's
                256: Llama-2-7B's 11008 features are 43 of them, so two ranks keep 22 and 21)
    after       o_proj and down_proj give partial sums on every rank: an all-reduce follows
                (workbench.distributed.tp)
    experts     a mixture's router replicated (every rank routes every token alike); the experts
                either whole, a contiguous run of them per rank (expert parallel: a rank runs
                the tokens routed to its experts, zeros for the others'), or each expert's FFN
                split as a dense MLP's (tensor parallel); both end in the MLP's all-reduce,
                which brings every token the sum over its experts (TPOptions.experts)
    norms       replicated
    embedding   replicated (every rank embeds the broadcast token ids itself)
    LM head     by vocabulary rows (each rank scores its slice: local top-k, then a gather);
                the "hidden-split" variant keeps columns of the hidden size instead (in fp32
                where block weights cannot be cut there: the variant is a study of the exchange)

Block-quantized matrices (workbench.model.weights.BlockTensor) are cut at whole blocks only,
rows anywhere, columns (wo's, down's) at block boundaries: a split that would cut a block is
an error naming the matrix and its block.

The ranks meet at both all-reduces of every layer, so each of the two parts between them (the
attention block, the MLP block) should take every rank the same time on its own: a rank that
finishes its part early waits at the all-reduce. Hence the query-head split where the KV heads
do not divide (the bundled model's 3 KV heads over 2 ranks: by KV heads 2 + 1, rank 0 holding
twice rank 1's attention weights; by query heads 5 + 4 of the 9, with KV heads 0-1 and 1-2,
14 : 12 in units of head_dim x dim), and an even FFN split whatever the attention split
(leaning it against an uneven attention split would equalize a rank's bytes per layer and
unbalance the MLP part as well). More ranks than KV heads split by query heads (Gemma 3 270M's
one KV head on both of two ranks); a KV head held by more than two ranks is refused.

A KV head that two ranks hold is computed once where the collective can hand it over
one-sided (shm; ShardPlan.kv_handoff, kernels/decode_step.cpp): the later rank computes its k
and v first thing in the layer and hands them over, the earlier one (which has the extra
query head) skips those rows and takes them. The bundled model's split is then 12 : 12, and
both ranks still hold the head's weights (the Python path and the other backends compute it
on both).
"""

from __future__ import annotations

import math
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


def ffn_split(cfg: ModelConfig, world: int, rank: int, align: int = FFN_ALIGN) -> tuple[int, int]:
    """[lo, hi) of the FFN features rank keeps: whole steps of `align` features split as evenly
    as split() splits them (the last rank also takes the features past the last whole step);
    a plain even split where there are fewer steps than ranks."""
    steps = cfg.ffn_dim // align
    if steps < world:
        return split(cfg.ffn_dim, world, rank)
    lo, hi = split(steps, world, rank)
    return lo * align, cfg.ffn_dim if rank == world - 1 else hi * align


def ffn_align(w_down) -> int:
    """The FFN split's step for a layer whose down projection is w_down: FFN_ALIGN, or the
    block of a block format where that is longer (a K-quant's 256 features)."""
    from workbench.model.weights import BlockTensor

    return math.lcm(FFN_ALIGN, w_down.fmt.block_geometry[0]) if isinstance(w_down, BlockTensor) else FFN_ALIGN


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
    experts: tuple[int, int] = (0, 0)  # a mixture's: [lo, hi) of the experts this rank keeps (all: tensor split)
    expert_split: str = ""  # "expert" or "tensor" for a mixture (each expert's FFN then split by `ffn`)

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
    if world > cfg.n_kv_heads:  # some rank would have no KV head of its own: the query heads decide
        return by_q(rank)

    def busiest(how):  # wq and wo: 2 x hd x dim per query head; wk and wv: the same per KV head
        return max(2 * (q[1] - q[0]) + 2 * (kv[1] - kv[0]) for q, kv, _ in map(how, range(world)))

    return (by_q if busiest(by_q) < busiest(by_kv) else by_kv)(rank)


def plan(cfg: ModelConfig, rank: int, world: int, align: int = FFN_ALIGN, expert_split: str = "expert") -> ShardPlan:
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"ranks must be a positive integer, got {world!r}")
    if world > cfg.n_heads or _most_holders(cfg, world) > 2:
        most = max(w for w in range(1, cfg.n_heads + 1) if _most_holders(cfg, w) <= 2)
        raise ValueError(f"{cfg.name} has {cfg.n_heads} query heads and {cfg.n_kv_heads} KV heads: a split over "
                         f"{world} ranks would give some rank no query head or some KV head to more than two ranks "
                         f"(the handoff of a shared head is between neighbours); at most {most} tensor-parallel ranks")
    q, kv, q_offset = attention_split(cfg, world, rank)
    ffn, experts, how = ffn_split(cfg, world, rank, align), (0, cfg.n_experts), ""
    if cfg.n_experts:
        how = expert_split
        if how == "expert":
            if world > cfg.n_experts:
                raise ValueError(f"{cfg.name} has {cfg.n_experts} experts: expert parallel over {world} ranks would "
                                 f"leave some rank none")
            ffn, experts = (0, cfg.ffn_dim), split(cfg.n_experts, world, rank)
        elif how != "tensor":
            raise ValueError(f"expert_split must be 'expert' or 'tensor', got {expert_split!r}")
    return ShardPlan(rank, world, kv, q, ffn, split(cfg.vocab_size, world, rank), split(cfg.dim, world, rank),
                     q_offset, cfg.n_heads // cfg.n_kv_heads, experts, how)


def _most_holders(cfg: ModelConfig, world: int) -> int:
    """The most ranks that hold any one KV head under the split over `world` ranks."""
    if world > cfg.n_heads:
        return world
    held = [0] * cfg.n_kv_heads
    for r in range(world):
        _, (lo, hi), _ = attention_split(cfg, world, r)
        for h in range(lo, hi):
            held[h] += 1
    return max(held)


def shares_kv_head(cfg: ModelConfig, world: int) -> bool:
    """Whether the split over `world` ranks leaves some KV head on two ranks (ShardPlan.kv_handoff)."""
    return 1 < world <= cfg.n_kv_heads and any(plan(cfg, r, world).kv_handoff[1] for r in range(world))


def take(p: ShardPlan, head_dim: int, layer: int | None, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The slices of one layer's unfused weights (layer None: the embedding, final norm and LM
    head dict) that the rank of plan p keeps (see the module docstring). Slices are copied
    (contiguous), so the full matrices can be freed as loading goes."""
    q = (p.q_heads[0] * head_dim, p.q_heads[1] * head_dim)
    kv = slice(p.kv_heads[0] * head_dim, p.kv_heads[1] * head_dim)
    ffn = p.ffn
    if layer is None:  # embedding (replicated), final norm, LM head by vocabulary
        head = w["lm_head"]
        try:
            hidden = _cols(head, *p.hidden, "lm_head")
        except ValueError:  # blocks the hidden split would cut: this variant's head in fp32
            hidden = head.dequantize()[:, slice(*p.hidden)].contiguous()
        return {"embedding": w["embedding"], "final_norm": w["final_norm"],
                "lm_head": _rows(head, slice(*p.vocab)), "lm_head_hidden_split": hidden}
    out = {"attn_norm": w["attn_norm"], "mlp_norm": w["mlp_norm"],
           "wq": _rows(w["wq"], slice(*q)), "wk": _rows(w["wk"], kv), "wv": _rows(w["wv"], kv),
           "wo": _cols(w["wo"], *q, f"layer {layer}'s wo")}
    if "router" in w:  # a mixture: the router whole; the experts this rank keeps, whole or their FFN slice
        out["router"] = w["router"]
        for e in range(*p.experts):
            out.update({f"experts.{e}.w_gate": _rows(w[f"experts.{e}.w_gate"], slice(*ffn)),
                        f"experts.{e}.w_up": _rows(w[f"experts.{e}.w_up"], slice(*ffn)),
                        f"experts.{e}.w_down": _cols(w[f"experts.{e}.w_down"], *ffn, f"layer {layer}'s expert {e}")})
    else:
        out.update({"w_gate": _rows(w["w_gate"], slice(*ffn)), "w_up": _rows(w["w_up"], slice(*ffn)),
                    "w_down": _cols(w["w_down"], *ffn, f"layer {layer}'s w_down")})
    # what a family adds: q / k / v biases split with their rows; the per-head q / k norms and
    # the norms after the all-reduced o_proj and down_proj whole on every rank
    out.update({name: w[name][rows].contiguous() for name, rows in (("bq", slice(*q)), ("bk", kv), ("bv", kv))
                if name in w})
    out.update({name: w[name] for name in ("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm") if name in w})
    return out


def _rows(w, rows: slice):
    """Rows of a matrix: a copy of a tensor's; a BlockTensor's whole rows (its own blocks)."""
    from workbench.model.weights import BlockTensor

    return w.take_rows(rows) if isinstance(w, BlockTensor) else w[rows].contiguous()


def _cols(w, lo: int, hi: int, what: str):
    """Columns [lo, hi) of a matrix: a copy of a tensor's; a BlockTensor's whole blocks (a
    ValueError naming the matrix where the split would cut one)."""
    from workbench.model.weights import BlockTensor

    if not isinstance(w, BlockTensor):
        return w[:, lo:hi].contiguous()
    try:
        return w.take_cols(lo, hi)
    except ValueError as e:
        raise ValueError(f"tensor parallel cannot split {what} ({w.fmt.name}) at columns [{lo}, {hi}): {e}") from None
