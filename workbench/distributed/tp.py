"""Tensor parallelism applied to a loaded shard, beside the model (the way gpt-fast's tp.py
leaves model.py alone): `apply_tensor_parallel(model, comm, options)` gives the fused decode
step the backend's all-reduce (`model.llama.collective`: it runs after o_proj and down_proj
inside the one C++ call), wraps o_proj and down_proj with the same all-reduce for the Python
reference path and prefill, and replaces the embedding lookup and the LM head with their
distributed forms. The model's shard was taken at load time (workbench.distributed.shard).

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

With check_topk, every step also gathers all logits and records whether the mode's top-1
is the true top-1 and how much of the true top-k it found (`TensorParallel.topk_log`).

Every rank samples from identical logits with the same seed, so all choose the same token;
the broadcast from rank 0 then makes rank 0's choice the one everybody embeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workbench import kernels
from workbench.distributed.comm import CommError
from workbench.model.llama import rms_norm

TOKEN_BROADCAST = ("ids", "embeddings")
LM_HEAD = ("topk", "gather", "hidden-split")


@dataclass
class TPOptions:
    token_broadcast: str = "ids"
    lm_head: str = "topk"
    zero_copy: bool = True
    topk: int = 8  # (value, id) pairs each rank contributes in the topk and hidden-split modes
    check_topk: bool = False

    def __post_init__(self):
        if self.token_broadcast not in TOKEN_BROADCAST:
            raise ValueError(f"token_broadcast must be one of {', '.join(TOKEN_BROADCAST)}, got {self.token_broadcast!r}")
        if self.lm_head not in LM_HEAD:
            raise ValueError(f"lm_head must be one of {', '.join(LM_HEAD)}, got {self.lm_head!r}")
        if not isinstance(self.zero_copy, bool):
            raise ValueError(f"zero_copy must be True or False, got {self.zero_copy!r}")
        if isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk < 1:
            raise ValueError(f"topk must be a positive integer, got {self.topk!r}")


class ReducedLinear:
    """A row-split linear layer (o_proj, down_proj) followed by the all-reduce of its partial
    sums; the all-reduce's time goes to the step's "comm" part of this layer."""

    def __init__(self, linear, tp: TensorParallel, layer: int, part: str):
        self.linear, self.tp, self.layer, self.part = linear, tp, layer, part
        self.weight, self.scale = linear.weight, linear.scale  # what the fused step reads

    @property
    def nbytes(self) -> int:
        return self.linear.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        comm = self.tp.comm
        out = comm.buffer((x.shape[0], self.weight.shape[0]))
        if self.tp.options.zero_copy:
            self.linear(x, out=out)  # straight into the collective's buffer
        else:
            out.copy_(self.linear(x))
        comm.all_reduce_(out)
        if self.tp.recording and comm.log:  # the collective's own timing of this call
            self.tp.add_comm(self.layer, self.part, comm.log[-1].seconds)
        return out


@dataclass
class TensorParallel:
    """The distributed pieces attached to one rank's model."""

    comm: object
    options: TPOptions
    vocab: tuple[int, int]
    vocab_size: int
    recording: bool = False
    comm_s: dict = field(default_factory=dict)  # (layer, part) -> seconds in this step
    topk_log: list[dict] = field(default_factory=list)

    def add_comm(self, layer: int, part: str, seconds: float) -> None:
        if self.recording:
            self.comm_s[(layer, part)] = self.comm_s.get((layer, part), 0.0) + seconds


def apply_tensor_parallel(model, comm, options: TPOptions | None = None) -> TensorParallel:
    """Make `model` (a workbench Model holding this rank's shard) one rank of a tensor-
    parallel run over `comm`. Returns the TensorParallel state (also model.tp)."""
    from workbench.distributed.shard import plan, split

    llama, cfg = model.llama, model.config
    p = plan(cfg, comm.rank, comm.world)
    tp = TensorParallel(comm, options or TPOptions(), p.vocab, cfg.vocab_size)
    llama.head_map = p.head_map  # where the shard cut a group of query heads, which KV head each reads
    for i, layer in enumerate(llama.layers):
        layer.wo = ReducedLinear(layer.wo, tp, i, "attention")
        layer.w_down = ReducedLinear(layer.w_down, tp, i, "mlp")
    head_hidden = llama.extras["lm_head_hidden_split"]
    hidden = p.hidden
    slice_width = -(-cfg.vocab_size // comm.world)  # gathered slices are padded to one width

    def embed(tokens: torch.Tensor) -> torch.Tensor:
        if tp.options.token_broadcast == "ids":
            tokens = comm.broadcast_(tokens.clone(), 0)
            return llama.embedding[tokens].float()
        x = llama.embedding[tokens].float() if comm.rank == 0 else torch.empty(tokens.numel(), cfg.dim)
        return comm.broadcast_(x, 0)

    widths = [hi - lo for lo, hi in (split(cfg.vocab_size, comm.world, r) for r in range(comm.world))]

    def full_logits(h: torch.Tensor) -> torch.Tensor:
        """Every logit, gathered from the vocabulary slices: [rows, vocab]."""
        local = llama.lm_head(h)
        padded = torch.full((h.shape[0], slice_width), float("-inf"))
        padded[:, :local.shape[1]] = local
        parts = comm.all_gather(padded)  # [world, rows, width]
        return torch.cat([parts[r, :, :widths[r]] for r in range(comm.world)], dim=1)

    def sparse(rows: int, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Logits that are -inf but at the candidates: what sample() needs for greedy / top-k."""
        out = torch.full((rows, cfg.vocab_size), float("-inf"))
        return out.scatter_(1, ids, values)

    def head(x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, llama.final_norm, cfg.norm_eps)
        rows, k = h.shape[0], tp.options.topk
        mode = tp.options.lm_head
        if mode == "gather":
            logits = full_logits(h)
        elif mode == "topk":
            local = llama.lm_head(h)
            values, ids = local.topk(min(k, local.shape[1]), dim=-1)
            # One exchange of (value, id) pairs; ids travel as fp32, exact below 2^24.
            pairs = comm.all_gather(torch.cat([values, (ids + p.vocab[0]).float()], dim=1))  # [world, rows, 2k]
            kk = values.shape[1]
            all_values = pairs[:, :, :kk].permute(1, 0, 2).reshape(rows, -1)
            all_ids = pairs[:, :, kk:].permute(1, 0, 2).reshape(rows, -1).long()
            best, where = all_values.topk(kk, dim=-1)
            logits = sparse(rows, all_ids.gather(1, where), best)
        else:  # hidden-split: partial sums of every logit
            partial = kernels.linear(h[:, hidden[0]:hidden[1]].contiguous(), head_hidden)  # [rows, vocab]
            _, ids = partial.topk(k, dim=-1)
            candidates = comm.all_gather(ids.float()).permute(1, 0, 2).reshape(rows, -1).long()  # [rows, world k]
            exact = comm.all_reduce_(partial.gather(1, candidates).contiguous())  # exact logits of the candidates
            logits = sparse(rows, candidates, exact)
        if tp.options.check_topk:
            truth = (comm.all_reduce_(kernels.linear(h[:, hidden[0]:hidden[1]].contiguous(), head_hidden))
                     if mode == "hidden-split" else full_logits(h))
            true_top = truth.topk(k, dim=-1).indices
            got_top = logits.topk(k, dim=-1).indices
            for r in range(rows):
                tp.topk_log.append({"top1_agrees": bool(got_top[r, 0] == true_top[r, 0]),
                                    "topk_overlap": len(set(got_top[r].tolist()) & set(true_top[r].tolist())) / k})
        return logits

    llama._embed, llama._head = embed, head
    collective = comm.step_collective()  # the fused step's all-reduces, called from C++
    llama.collective = collective

    def begin(record: bool) -> None:
        tp.recording = comm.recording = record
        tp.comm_s.clear()
        comm.take_log()
        if hasattr(collective, "zero_copy"):  # the switch, for the fused step too
            collective.zero_copy = tp.options.zero_copy
        if hasattr(collective, "wait_s"):  # the fused step's waits, this step's only
            collective.wait_s = 0.0

    def end(rec):
        if rec is not None:
            _attribute_comm(rec, tp, comm.take_log(), getattr(collective, "wait_s", None))
        return rec

    prefill, decode = llama.prefill, llama.decode

    def tp_prefill(tokens, seq_lens, cache, switches, record=False, all_logits=False):
        begin(record)
        logits, rec = prefill(tokens, seq_lens, cache, switches, record, all_logits)
        return logits, end(rec)

    def tp_decode(tokens, cache, switches, record=False):
        begin(record)
        try:
            logits, rec = decode(tokens, cache, switches, record)
        except kernels.native.ext.CollectiveError as e:  # the fused step's shm or oneCCL all-reduce failed
            raise CommError(str(e)) from None
        return logits, end(rec)

    llama.prefill, llama.decode = tp_prefill, tp_decode
    model.tp = tp
    return tp


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
