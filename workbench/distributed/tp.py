"""Tensor parallelism as a property of the model, built at load: a rank passes
`TensorParallel(comm, options)` to load_model (`parallel=`), which keeps the rank's shard
of each layer as the weights load (workbench.distributed.shard) and gives the fused decode
step the backend's all-reduce (`model.llama.collective`: it runs after o_proj and down_proj
inside the one C++ call, natively for shm and oneCCL, through Python for gloo). The Python
reference path (prefill, and decode with step="reference") calls the same all-reduce after
o_proj and down_proj (`TensorParallel.reduce`), and the embedding lookup and the LM head take
their distributed forms (`embed`, `head`); workbench.model.llama.Parallel lists what the
model calls.

The paper's three communication optimizations, each a switch against its naive form
(`TPOptions`, changeable between generations):

    token_broadcast   "ids": rank 0 broadcasts the token ids (8 bytes each) and every rank
                      embeds them itself; "embeddings": rank 0 embeds and broadcasts the
                      vectors (hidden x 4 bytes each)
    lm_head           "topk": each rank scores its vocabulary slice, takes its local top-k
                      and only (value, id) pairs are gathered; the global top-k is exactly
                      among them. "gather": every rank's logits are gathered. "hidden-split":
                      the head is split along the hidden size, so a rank holds partial sums
                      of every logit; candidates from each rank's local top-k are summed
                      exactly, but the true best token may not be among them (approximate)
    zero_copy         on: o_proj / down_proj write their output straight into the buffer
                      the all-reduce reduces (linear(..., out=buffer)); off: they write a
                      fresh tensor, which is then copied into it. On the fused C++ step only
                      shm has such a buffer (Backend.fused_zero_copy): gloo and oneCCL reduce
                      the step's own output in place, so there the switch changes only the
                      Python path (prefill, and decode with step="reference")

One more switch of ours, not the paper's:

    kv_handoff        on: a KV head two ranks hold (the query-head split,
                      ShardPlan.kv_handoff) is computed by one and handed to the other,
                      one-sided, inside the fused step; off: both compute it. Only shm can
                      hand off (ShmCollective.hands_off); elsewhere both always compute it

With check_topk, every step also gathers all logits and records whether the mode's top-1
is the true top-1 and how much of the true top-k it found (`TensorParallel.topk_log`).

Every rank samples from identical logits with the same seed, so all choose the same token;
the broadcast from rank 0 then makes rank 0's choice the one everybody embeds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench import kernels
from workbench.distributed.shard import FFN_ALIGN, ShardPlan, ffn_align, plan, split, take
from workbench.model.config import ModelConfig
from workbench.model.llama import Linear, embed_rows, rms_norm

TOKEN_BROADCAST = ("ids", "embeddings")
LM_HEAD = ("topk", "gather", "hidden-split")
EXPERT_SPLITS = ("expert", "tensor")  # a mixture's experts: whole experts per rank, or each one's FFN split


@dataclass
class TPOptions:
    token_broadcast: str = "ids"
    lm_head: str = "topk"
    zero_copy: bool = True
    kv_handoff: bool = True
    topk: int = 8  # (value, id) pairs each rank contributes in the topk and hidden-split modes
    check_topk: bool = False
    # A mixture of experts' split, fixed at load (it decides which weights a rank keeps):
    # "expert" (expert parallel: each rank holds a contiguous run of whole experts and runs
    # the tokens routed to them; the all-reduce brings every token its experts' outputs) or
    # "tensor" (each expert's FFN split over the ranks as a dense MLP's is)
    experts: str = "expert"

    def __post_init__(self):
        if self.token_broadcast not in TOKEN_BROADCAST:
            raise ValueError(f"token_broadcast must be one of {', '.join(TOKEN_BROADCAST)}, got {self.token_broadcast!r}")
        if self.lm_head not in LM_HEAD:
            raise ValueError(f"lm_head must be one of {', '.join(LM_HEAD)}, got {self.lm_head!r}")
        for name in ("zero_copy", "kv_handoff"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.experts not in EXPERT_SPLITS:
            raise ValueError(f"experts must be one of {', '.join(EXPERT_SPLITS)}, got {self.experts!r}")
        if isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk < 1:
            raise ValueError(f"topk must be a positive integer, got {self.topk!r}")


class TensorParallel:
    """One rank's part in a tensor-parallel model: the workbench.model.llama.Parallel given to
    load_model, which keeps this rank's shard of the weights as they load and is called
    where a rank's forward pass differs from one process's."""

    def __init__(self, comm, options: TPOptions | None = None):
        self.comm = comm
        self.options = options or TPOptions()
        self.plan: ShardPlan | None = None  # known once the model's config is
        self.comm_s: dict = {}  # (layer, part) -> seconds of its all-reduce in this step
        self.topk_log: list[dict] = []
        self.put_floats = 0  # the fused step's KV handoffs so far, at the start of this step

    # -- at load ------------------------------------------------------------------------------
    def keep(self, cfg: ModelConfig, layer: int | None, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.plan is None:  # every rank loads the same file, so finds the same FFN step
            down = w.get("w_down", w.get("experts.0.w_down"))  # a mixture: its first expert's
            align = ffn_align(down) if layer is not None else FFN_ALIGN
            self.plan = plan(cfg, self.comm.rank, self.comm.world, align, self.options.experts)
        return take(self.plan, cfg.head_dim, layer, w)

    def attach(self, model) -> None:
        self.llama = model
        model.head_map = self.plan.head_map  # where the shard cut a group of query heads, which KV head each reads
        model.kv_handoff = self.plan.kv_handoff  # a KV head held with a neighbour: computed once, handed over
        model.collective = self.comm.step_collective()  # called from C++ by the fused step
        self.head_hidden = Linear(model.extras["lm_head_hidden_split"], None)  # in its own format (blocks stay blocks)
        world, vocab = self.comm.world, model.cfg.vocab_size
        self.widths = [hi - lo for lo, hi in (split(vocab, world, r) for r in range(world))]
        self.slice_width = max(self.widths)  # gathered slices are padded to one width

    # -- every step ---------------------------------------------------------------------------
    def begin(self, record: bool) -> None:
        self.comm.recording = record
        self.comm_s.clear()
        self.comm.take_log()
        collective = self.llama.collective
        if hasattr(collective, "zero_copy"):  # the switches, for the fused step too
            collective.zero_copy = self.options.zero_copy
        if hasattr(collective, "kv_handoff"):
            collective.kv_handoff = self.options.kv_handoff
        if hasattr(collective, "wait_s"):  # the fused step's waits, this step's only
            collective.wait_s = 0.0
        self.put_floats = getattr(collective, "put_floats", 0)  # what this step's KV handoffs send: the change

    def end(self, rec):
        if rec is not None:
            collective = self.llama.collective
            _attribute_comm(rec, self, self.comm.take_log(), getattr(collective, "wait_s", None))
            rec.comm_bytes += 4 * (getattr(collective, "put_floats", 0) - self.put_floats)  # the KV handoffs' floats
        return rec

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        comm, embedding = self.comm, self.llama.embedding
        if self.options.token_broadcast == "ids":
            tokens = comm.broadcast_(tokens.clone(), 0)
            return embed_rows(embedding, tokens)
        x = embed_rows(embedding, tokens) if comm.rank == 0 else torch.empty(tokens.numel(), self.llama.cfg.dim)
        return comm.broadcast_(x, 0)

    def reduce(self, linear, x: torch.Tensor, layer: int, part: str) -> torch.Tensor:
        """A row-split linear layer (o_proj, down_proj), then the all-reduce of its partial sums;
        the all-reduce's time goes to the step's "comm" part of this layer."""
        x = x.contiguous()
        comm = self.comm
        out = comm.buffer((x.shape[0], linear.out_features))
        if self.options.zero_copy:
            linear(x, out=out)  # straight into the collective's buffer
        else:
            out.copy_(linear(x))
        comm.all_reduce_(out)
        if comm.recording and comm.log:  # the collective's own timing of this call
            self.comm_s[(layer, part)] = self.comm_s.get((layer, part), 0.0) + comm.log[-1].seconds
        return out

    def head(self, x: torch.Tensor) -> torch.Tensor:
        llama, comm, vocab = self.llama, self.comm, self.plan.vocab
        h = rms_norm(x, llama.final_norm, llama.cfg.norm_eps)
        rows, k = h.shape[0], self.options.topk
        mode = self.options.lm_head
        if mode == "gather":
            logits = self._full_logits(h)
        elif mode == "topk":
            local = llama.lm_head(h)
            # One exchange of (value, id) pairs [world, rows, 2k], then the best k of them all:
            # each a single pass in C++ (ties go to the lower token id, as one process's argmax)
            pairs = comm.all_gather(kernels.topk_pairs(local, min(k, local.shape[1]), offset=vocab[0]))
            logits = kernels.merge_topk(pairs, llama.cfg.vocab_size)
        else:  # hidden-split: partial sums of every logit
            partial = self._hidden_split(h)  # [rows, vocab]
            _, ids = partial.topk(k, dim=-1)
            candidates = comm.all_gather(ids.float()).permute(1, 0, 2).reshape(rows, -1).long()  # [rows, world k]
            exact = comm.all_reduce_(partial.gather(1, candidates).contiguous())  # exact logits of the candidates
            logits = self._sparse(rows, candidates, exact)
        if self.options.check_topk:
            truth = comm.all_reduce_(self._hidden_split(h)) if mode == "hidden-split" else self._full_logits(h)
            true_top = truth.topk(k, dim=-1).indices
            got_top = logits.topk(k, dim=-1).indices
            for r in range(rows):
                self.topk_log.append({"top1_agrees": bool(got_top[r, 0] == true_top[r, 0]),
                                      "topk_overlap": len(set(got_top[r].tolist()) & set(true_top[r].tolist())) / k})
        return logits

    def _hidden_split(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's partial sums of every logit: the LM head's columns of its hidden slice."""
        lo, hi = self.plan.hidden
        return self.head_hidden(h[:, lo:hi].contiguous())

    def _full_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Every logit, gathered from the vocabulary slices: [rows, vocab]."""
        local = self.llama.lm_head(h)
        padded = torch.full((h.shape[0], self.slice_width), float("-inf"))
        padded[:, :local.shape[1]] = local
        parts = self.comm.all_gather(padded)  # [world, rows, width]
        return torch.cat([parts[r, :, :self.widths[r]] for r in range(self.comm.world)], dim=1)

    def _sparse(self, rows: int, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Logits that are -inf but at the candidates: what sample() needs for greedy / top-k."""
        out = torch.full((rows, self.llama.cfg.vocab_size), float("-inf"))
        return out.scatter_(1, ids, values)


def _attribute_comm(rec, tp: TensorParallel, calls, step_wait_s: float | None) -> None:
    """Move the layers' all-reduce time out of attention / MLP into "comm"; the head's
    collectives are the rest of the logged calls. The waits for the other ranks: the logged
    calls' and, on a fused step, its collective's (`step_wait_s`), where the backend measures
    them."""
    comm = rec.parts_s["comm"]
    for (layer, part), seconds in tp.comm_s.items():
        rec.parts_s[part][layer] -= seconds
        comm[layer] += seconds
    rec.comm_bytes += sum(c.bytes for c in calls)  # the fused step counted its own all-reduces
    rec.head_comm_s = sum(c.seconds for c in calls) - sum(tp.comm_s.values())
    waits = [c.wait_s for c in calls]
    if tp.comm.measures_waits and None not in waits:
        rec.comm_wait_s = (step_wait_s or 0.0) + sum(waits)
