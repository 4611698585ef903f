"""Where a mixture of experts sends its tokens, and what that does to the bytes a step reads.

    routing = wb.expert_routing(model)          # real text routed through every layer (a prefill)
    routing.load                  # [layers, experts]: tokens routed to each expert
    routing.entropy()             # per layer, bits: log2(experts) when every expert gets as many
    routing.busiest()             # per layer: the busiest expert's share of the routed tokens
    routing.expected_experts(16)  # per layer: distinct experts a step of 16 tokens touches
    wb.predict(model, batch=16, routing=routing)   # the cost model's bytes under that routing

A decode step of B tokens reads each expert that any of them chose once. A token chooses
top_k different experts, expert e with probability q_e (its share of the routed tokens times
top_k: the q_e of a layer sum to top_k); with the B tokens independent, expert e is left
unread with probability (1 - q_e)^B, so

    E[distinct experts of B tokens] = sum over e of 1 - (1 - q_e)^B

which is top_k at B = 1 and tends to every expert as B grows, faster the more even the
routing. Uniform routing (q_e = top_k / experts) is what the cost model assumes when it is
given none. The layers also count their load as the model runs (Layer.expert_load: every
prefill and every decode step, fused or not): `ExpertRouting.of_model` reads that live.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertRouting:
    """Tokens routed to each expert of each layer ([layers, experts] int64), of `tokens`
    tokens each choosing top_k experts; `source` says what was routed."""

    load: torch.Tensor
    tokens: int
    top_k: int
    source: str

    @classmethod
    def uniform(cls, cfg) -> ExpertRouting:
        """Every expert equally often: what the cost model assumes without a measurement."""
        if not cfg.n_experts:
            raise ValueError(f"{cfg.name} is not a mixture of experts (n_experts = 0)")
        load = torch.full((cfg.n_layers, cfg.n_experts), cfg.experts_per_token, dtype=torch.int64)
        return cls(load, cfg.n_experts, cfg.experts_per_token, "uniform (assumed)")

    @classmethod
    def of_model(cls, model, source: str = "everything the model ran since it was loaded") -> ExpertRouting:
        """The load the model's layers have counted so far (prefills and decode steps)."""
        layers = _moe_layers(model)
        load = torch.stack([layer.expert_load.clone() for layer in layers])
        top_k = layers[0].top_k
        return cls(load, int(load[0].sum()) // top_k, top_k, source)

    @property
    def n_experts(self) -> int:
        return self.load.shape[1]

    def inclusion(self) -> torch.Tensor:
        """[layers, experts] float64: the probability that a token chooses each expert (q_e)."""
        return self.load.double() / max(1, self.tokens)

    def expected_experts(self, batch: int) -> list[float]:
        """Per layer: the expected number of distinct experts `batch` tokens choose."""
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
        q = self.inclusion().clamp(0.0, 1.0)
        return (1.0 - (1.0 - q) ** batch).sum(-1).tolist()

    def entropy(self) -> list[float]:
        """Per layer: the entropy of the routed tokens' distribution over experts, in bits."""
        p = self.load.double() / self.load.sum(-1, keepdim=True).clamp(min=1)
        return (-(p * torch.where(p > 0, p.log2(), torch.zeros_like(p))).sum(-1)).tolist()

    def busiest(self) -> list[float]:
        """Per layer: the busiest expert's share of the routed tokens (1 / experts: even)."""
        return (self.load.double().amax(-1) / self.load.sum(-1).clamp(min=1)).tolist()

    def busiest_rank(self, ranks: int) -> list[float]:
        """Per layer: the busiest rank's share of the routed tokens with the experts split
        across `ranks` ranks in contiguous runs (expert parallel: each rank holds whole
        experts); 1 / ranks is even."""
        if not isinstance(ranks, int) or not 1 <= ranks <= self.n_experts:
            raise ValueError(f"ranks must be an integer in 1..{self.n_experts}, got {ranks!r}")
        bounds = [round(r * self.n_experts / ranks) for r in range(ranks + 1)]
        shares = torch.stack([self.load[:, a:b].sum(-1) for a, b in zip(bounds, bounds[1:])], -1).double()
        return (shares.amax(-1) / shares.sum(-1).clamp(min=1)).tolist()

    def rows(self) -> list[dict]:
        """One row per layer: tokens routed, entropy (bits, and of the even log2 E), the busiest
        expert's share, and the distinct experts expected at batch 1, 4, 16 and 64."""
        even = math.log2(self.n_experts)
        out = []
        expected = {b: self.expected_experts(b) for b in (1, 4, 16, 64)}
        for i, (h, top) in enumerate(zip(self.entropy(), self.busiest())):
            out.append({"layer": i, "routed": int(self.load[i].sum()), "entropy_bits": h, "even_bits": even,
                        "busiest_share": top, **{f"experts_B{b}": expected[b][i] for b in expected}})
        return out

    def __repr__(self) -> str:
        from workbench.analysis.tables import format_table

        head = (f"<ExpertRouting: {self.tokens} tokens x top {self.top_k} of {self.n_experts} experts, "
                f"{self.load.shape[0]} layers; {self.source}>\n")
        cols = ["layer", "routed", "entropy_bits", "busiest_share", "experts_B1", "experts_B4", "experts_B16",
                "experts_B64"]
        return head + format_table(self.rows(), cols, {c: "{:.2f}" for c in cols[2:]})


def _moe_layers(model) -> list:
    llama = getattr(model, "llama", model)
    layers = getattr(llama, "layers", None)
    if not layers or getattr(layers[0], "router", None) is None:
        name = getattr(getattr(model, "config", None), "name", type(model).__name__)
        raise ValueError(f"{name} is not a mixture of experts: expert routing needs a model with a router "
                         f"(Mixtral, Qwen3-MoE)")
    return layers


def expert_routing(model, text: str | None = None, tokens: int = 2048) -> ExpertRouting:
    """Route `tokens` tokens of `text` (default: the license texts Debian ships, real English)
    through the loaded model, a prefill of at most its context at a time, and count where each
    layer sent them. The model's own running count (Layer.expert_load) goes on as before."""
    from workbench.analysis.text import license_corpus

    layers = _moe_layers(model)
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be an integer >= 1, got {tokens!r}")
    source = "the given text" if text is not None else "the license texts in /usr/share/common-licenses"
    ids = model.tokenizer.encode(text if text is not None else license_corpus()[0])[:tokens]
    if not ids:
        raise ValueError("text: no tokens to route (empty text)")
    before = torch.stack([layer.expert_load.clone() for layer in layers])
    chunk = max(1, min(512, model.config.max_seq_len))
    with torch.inference_mode():
        for lo in range(0, len(ids), chunk):
            model.logits(ids[lo:lo + chunk])
    load = torch.stack([layer.expert_load for layer in layers]) - before
    return ExpertRouting(load, len(ids), layers[0].top_k, f"{len(ids)} tokens of {source}")
