"""The fused step's KV handoff (kernels/decode_step.cpp, workbench/distributed/shard.py), on
two ranks in one process: two threads, each stepping its own shard's DecodeStack over one
shared-memory segment (the step releases the GIL, and every collective it makes is native).

Where the query-head split cuts a group, the later rank computes the shared KV head's k and v
and hands them to the earlier one. Properties, over shapes, batch sizes and every weight
format (hypothesis):
- the ranks' results with the handoff are bitwise the results without it (the k and v the
  receiving rank takes are the numbers it would have computed);
- and both are the one-process step's, to fp32 rounding (fp32 weights);
- the handoff happens once a layer, from the rank that sends to the rank that takes;
on every build this host runs (the `kernels` fixture), the emulated AMX one included.
"""

from __future__ import annotations

import threading
import uuid
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from workbench.distributed.comm import SHM_DIR, create_shm_segment
from workbench.distributed.shard import plan
from workbench.model.config import ModelConfig
from workbench.model.llama import Linear
from workbench.model.weights import WEIGHT_FORMATS

ALSO_EMULATED = True  # conftest.py: the AVX-512 build's code too, on any AVX2 host

LMAX = 16
CAPACITY = 1 << 16


def config(kv_heads: int, group: int, head_dim: int) -> ModelConfig:
    return ModelConfig(name="handoff-test", dim=64, n_layers=2, n_heads=kv_heads * group, n_kv_heads=kv_heads,
                       ffn_dim=128, vocab_size=32, head_dim=head_dim)


def quantized(w: torch.Tensor, fmt: str) -> Linear:
    """A linear layer's weight in one of the fused step's formats (WEIGHT_FORMATS' names)."""
    return Linear(w.contiguous(), WEIGHT_FORMATS[fmt])


def full_weights(cfg: ModelConfig, gen: torch.Generator) -> list[dict]:
    d, hd = cfg.dim, cfg.head_dim
    shapes = {"wq": (cfg.n_heads * hd, d), "wk": (cfg.n_kv_heads * hd, d), "wv": (cfg.n_kv_heads * hd, d),
              "wo": (d, cfg.n_heads * hd), "w_gate": (cfg.ffn_dim, d), "w_up": (cfg.ffn_dim, d),
              "w_down": (d, cfg.ffn_dim)}
    return [{name: torch.randn(*shape, generator=gen) / shape[1] ** 0.5 for name, shape in shapes.items()}
            | {"attn_norm": 1 + 0.1 * torch.randn(d, generator=gen), "mlp_norm": 1 + 0.1 * torch.randn(d, generator=gen)}
            for _ in range(cfg.n_layers)]


def stack_of(ks, cfg, layers, history, fmt, p=None, handoff=(False, False)):
    """One rank's fused step (the whole model where p is None): its slices of the weights and of
    the KV history (fp32 caches of LMAX positions)."""
    hd = cfg.head_dim
    q = slice(*(h * hd for h in (p.q_heads if p else (0, cfg.n_heads))))
    kv = slice(*(h * hd for h in (p.kv_heads if p else (0, cfg.n_kv_heads))))
    ffn = slice(*(p.ffn if p else (0, cfg.ffn_dim)))
    heads = slice(*(p.kv_heads if p else (0, cfg.n_kv_heads)))
    built, caches = [], []
    for w, (k, v) in zip(layers, history):
        built.append(SimpleNamespace(
            attn_norm=w["attn_norm"], mlp_norm=w["mlp_norm"],
            wqkv=quantized(torch.cat([w["wq"][q], w["wk"][kv], w["wv"][kv]]), fmt),
            wo=quantized(w["wo"][:, q], fmt),
            w_gate_up=quantized(torch.cat([w["w_gate"][ffn], w["w_up"][ffn]]), fmt),
            w_down=quantized(w["w_down"][:, ffn], fmt)))
        caches.append((k[:, heads].contiguous(), v[:, heads].contiguous(), None, None))
    group, q_offset = (p.head_map or (0, 0)) if p else (0, 0)
    n_heads = (p.q_heads[1] - p.q_heads[0]) if p else cfg.n_heads
    return ks.decode_stack(built, caches, heads=n_heads, eps=1e-5, group=group, q_offset=q_offset,
                                       kv_handoff=handoff)


def two_ranks(ks, cfg, layers, history, fmt, x, cos, sin, positions, handoff: bool):
    """Both ranks' x after one step, and (puts, gets) of each rank's collective."""
    name = f"workbench-test-handoff-{uuid.uuid4().hex[:8]}"
    path = create_shm_segment(name, 2, CAPACITY)
    try:
        size = ks.ext.shm_segment_bytes(2, CAPACITY)
        segment = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        outs, colls, errors = [x.clone(), x.clone()], [], []
        stacks = []
        for rank in range(2):
            p = plan(cfg, rank, 2)
            stacks.append(stack_of(ks, cfg, layers, history, fmt, p, p.kv_handoff))
            coll = ks.ext.ShmCollective(segment, rank, 2, CAPACITY, 20.0)
            coll.kv_handoff = handoff
            colls.append(coll)

        def run(rank):
            try:
                stacks[rank].step(outs[rank], cos, sin, positions, None, colls[rank])
            except Exception as e:  # noqa: BLE001 - reported below, with the rank
                errors.append((rank, e))

        threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and not any(t.is_alive() for t in threads), errors
        return outs, [(c.puts, c.gets) for c in colls]
    finally:
        path.unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def _one_thread_each():
    """Each rank one thread, as the cluster runs them (and two ranks on two cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# (KV heads, query heads per KV head) whose query-head split over 2 ranks cuts a group
SHARED = [(3, 3), (7, 2), (5, 2), (3, 5), (5, 3)]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(SHARED), st.sampled_from([32, 64]), st.integers(1, 3),
       st.sampled_from(["fp32", "bf16", "int8", "int8-g32", "q8_0", "q4_0"]), st.integers(0, 2**31 - 1))
def test_the_handed_over_kv_head_is_the_one_the_rank_would_compute(kernels, heads, head_dim, batch, fmt, seed):
    kv_heads, group = heads
    cfg = config(kv_heads, group, head_dim)
    plans = [plan(cfg, r, 2) for r in range(2)]
    assert [p.kv_handoff for p in plans] == [(False, True), (True, False)]  # the split shares a head
    gen = torch.Generator().manual_seed(seed)
    layers = full_weights(cfg, gen)
    history = [(torch.randn(batch, kv_heads, LMAX, head_dim, generator=gen),
                torch.randn(batch, kv_heads, LMAX, head_dim, generator=gen)) for _ in range(cfg.n_layers)]
    positions = torch.randint(0, LMAX, (batch,), generator=gen)
    x = torch.randn(batch, cfg.dim, generator=gen)
    angles = torch.rand(batch, head_dim // 2, generator=gen) * 6.28
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    # each run appends the new token to the caches: every run starts from the same history
    fresh = lambda: [(k.clone(), v.clone()) for k, v in history]  # noqa: E731

    on, counts_on = two_ranks(kernels, cfg, layers, fresh(), fmt, x, cos, sin, positions, handoff=True)
    off, counts_off = two_ranks(kernels, cfg, layers, fresh(), fmt, x, cos, sin, positions, handoff=False)
    assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])
    assert torch.equal(on[0], on[1])  # the all-reduce leaves every rank the same sum
    assert counts_on == [(0, cfg.n_layers), (cfg.n_layers, 0)] and counts_off == [(0, 0), (0, 0)]
    if fmt == "fp32":  # the split's sums in another order than one process's: fp32 rounding
        one = x.clone()
        stack_of(kernels, cfg, layers, fresh(), fmt).step(one, cos, sin, positions, None)
        assert (on[0] - one).abs().max() <= 1e-4 * one.abs().max(), (on[0] - one).abs().max()


def test_a_split_by_whole_kv_heads_hands_nothing_over():
    for kv_heads, group in ((2, 3), (4, 1), (6, 2)):
        cfg = config(kv_heads, group, 32)
        assert [plan(cfg, r, 2).kv_handoff for r in range(2)] == [(False, False)] * 2


@given(st.integers(1, 8), st.integers(1, 6), st.integers(2, 6))
def test_each_rank_that_takes_a_head_has_a_neighbour_that_sends_it(kv_heads, group, world):
    """Rank r takes its last KV head exactly where rank r + 1 sends its first, and a rank's
    first and last KV heads are different heads where it both sends and takes."""
    if world > kv_heads:
        return
    cfg = config(kv_heads, group, 32)
    plans = [plan(cfg, r, world) for r in range(world)]
    assert not plans[0].kv_handoff[0] and not plans[-1].kv_handoff[1]
    for a, b in zip(plans, plans[1:]):
        assert a.kv_handoff[1] == b.kv_handoff[0]
        if a.kv_handoff[1]:
            assert a.kv_heads[1] - 1 == b.kv_heads[0]  # the same head
    for p in plans:
        if all(p.kv_handoff):
            assert p.kv_heads[1] - p.kv_heads[0] >= 2


def test_a_stack_that_both_sends_and_takes_needs_two_kv_heads():
    from workbench.kernels import native

    cfg = config(1, 2, 32)
    gen = torch.Generator().manual_seed(0)
    history = [(torch.zeros(1, 1, LMAX, 32), torch.zeros(1, 1, LMAX, 32)) for _ in range(cfg.n_layers)]
    with pytest.raises(ValueError, match="kv_send and kv_recv name the first and the last KV head"):
        stack_of(native, cfg, full_weights(cfg, gen), history, "fp32", handoff=(True, True))
    with pytest.raises(ValueError, match="kv_handoff must be a \\(send, recv\\) pair of bools, got 'yes'"):
        stack_of(native, cfg, full_weights(cfg, gen), history, "fp32", handoff="yes")


def test_no_segment_is_left_behind():
    assert not list(SHM_DIR.glob("workbench-test-handoff-*"))
