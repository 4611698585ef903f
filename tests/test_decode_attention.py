"""Decode attention against the float64 reference, for every cache dtype and ISA build.

The reference reads exactly the values stored in the cache (fp16/bf16 upcast, int8 times
its per-token scale), so what is tested is the kernel's arithmetic: fp32 accumulation
(1e-5 absolute + 1e-5 relative; measured worst ~3e-7). The bf16-q case rounds the output
to bf16 once (half an ulp: 2^-9 relative), so 4e-3.

Separately, an int8 cache must stay within the error its quantization implies of the
fp32-cache result (test_int8_cache_error_within_quantization_bound).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference import decode_reference

# Also on the "emulated" build (conftest.py): the AVX-512 path, VNNI included, on any AVX2 host.
ALSO_EMULATED = True

CACHE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]


@st.composite
def decode_case(draw):
    # GQA ratios cover every register blocking of the score pass (rows per pass 8, 4, 2) and
    # groups wider than one pass of 8 heads (12); head dims include partial vectors (20, 72).
    ratio = draw(st.sampled_from([1, 3, 4, 6, 7, 8, 12]))
    return dict(
        B=draw(st.integers(1, 4)),
        Hkv=draw(st.integers(1, 3)),
        ratio=ratio,
        Lmax=draw(st.integers(1, 600)),
        D=draw(st.sampled_from([64, 128, 80, 72, 20])),
        cache_dtype=draw(st.sampled_from(CACHE_DTYPES)),
        q_dtype=draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16])),
        num_splits=draw(st.one_of(st.none(), st.integers(1, 9))),
        ragged=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def build_cache(kernels, B, Hkv, Lmax, D, dtype, gen):
    """Random K/V in a cache of `dtype`, written through the append kernel."""
    k = torch.randn(B, Hkv, Lmax, D, generator=gen)
    v = torch.randn(B, Hkv, Lmax, D, generator=gen)
    k_cache = torch.zeros(B, Hkv, Lmax, D, dtype=dtype)
    v_cache = torch.zeros(B, Hkv, Lmax, D, dtype=dtype)
    scales = {}
    if dtype == torch.int8:
        scales = dict(k_scale=torch.zeros(B, Hkv, Lmax), v_scale=torch.zeros(B, Hkv, Lmax))
    start = torch.zeros(B, dtype=torch.int64)
    kernels.kv_cache_append(k_cache, k, start, scales=scales.get("k_scale"))
    kernels.kv_cache_append(v_cache, v, start, scales=scales.get("v_scale"))
    return k, v, k_cache, v_cache, scales


@given(c=decode_case())
def test_decode_matches_reference(kernels, c):
    gen = torch.Generator().manual_seed(c["seed"])
    B, Hkv, Lmax, D = c["B"], c["Hkv"], c["Lmax"], c["D"]
    H = Hkv * c["ratio"]
    _, _, k_cache, v_cache, scales = build_cache(kernels, B, Hkv, Lmax, D, c["cache_dtype"], gen)
    q = torch.randn(B, H, D, generator=gen).to(c["q_dtype"])
    if c["ragged"]:
        lengths = torch.randint(1, Lmax + 1, (B,), generator=gen, dtype=torch.int32)
    else:
        lengths = torch.full((B,), Lmax, dtype=torch.int64)
    out = kernels.decode_attention(q, k_cache, v_cache, lengths, num_splits=c["num_splits"], **scales)
    assert out.dtype == c["q_dtype"] and out.shape == (B, H, D)
    ref = decode_reference(q, k_cache, v_cache, lengths, **scales)
    tol = 1e-5 if c["q_dtype"] == torch.float32 else 4e-3
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@st.composite
def uneven_groups(draw):
    """A tensor-parallel rank's heads where its shard cut groups of query heads: the model's
    group size, how many of the first group's heads are elsewhere (q_offset), the rank's KV
    heads, and its query heads (the last group possibly cut short too)."""
    group = draw(st.integers(1, 9))
    q_offset = draw(st.integers(0, group - 1))
    Hkv = draw(st.integers(1, 3))
    H = Hkv * group - q_offset - draw(st.integers(0, group - 1))  # the last group may end early
    return dict(group=group, q_offset=q_offset, Hkv=Hkv, H=H) if H + q_offset > (Hkv - 1) * group and H >= 1 else \
        dict(group=group, q_offset=0, Hkv=Hkv, H=Hkv * group)


@given(g=uneven_groups(), B=st.integers(1, 3), Lmax=st.integers(1, 200), D=st.sampled_from([64, 72, 20]),
       cache_dtype=st.sampled_from(CACHE_DTYPES), int8_kernel=st.sampled_from(["widen", "dot", "tile"]),
       num_splits=st.one_of(st.none(), st.integers(1, 5)), seed=st.integers(0, 2**16))
def test_uneven_groups_read_their_kv_heads(kernels, g, B, Lmax, D, cache_dtype, int8_kernel, num_splits, seed):
    """With group and q_offset, query head h reads KV head (h + q_offset) // group: against
    the float64 reference (fp32 accumulation), and for the int8 kernels that round the query
    or the probabilities against the same kernel on a cache with one copy of each query
    head's KV head (the heads are computed alike either way)."""
    gen = torch.Generator().manual_seed(seed)
    H, Hkv, head_map = g["H"], g["Hkv"], (g["group"], g["q_offset"])
    index = (torch.arange(H) + g["q_offset"]) // g["group"]
    q = torch.randn(B, H, D, generator=gen)
    lengths = torch.randint(1, Lmax + 1, (B,), generator=gen)
    if int8_kernel == "tile" or (int8_kernel == "dot" and cache_dtype == torch.int8):
        if int8_kernel == "tile":
            if D % 4:
                return
            _, _, tiles, tiled_scales = build_tiled(kernels, B, Hkv, Lmax, D, gen)
            kc, vc, scales = tiles["k"], tiles["v"], tiled_scales
        else:
            _, _, kc, vc, scales = build_cache(kernels, B, Hkv, Lmax, D, torch.int8, gen)
        out = kernels.decode_attention(q, kc, vc, lengths, num_splits=num_splits, int8_kernel=int8_kernel,
                                       group=g["group"], q_offset=g["q_offset"], **scales)
        spread = {n: t[:, index].contiguous() for n, t in scales.items()}
        same = kernels.decode_attention(q, kc[:, index].contiguous(), vc[:, index].contiguous(), lengths,
                                        num_splits=num_splits, int8_kernel=int8_kernel, **spread)
        torch.testing.assert_close(out, same, atol=1e-5, rtol=1e-5)
        return
    _, _, kc, vc, scales = build_cache(kernels, B, Hkv, Lmax, D, cache_dtype, gen)
    out = kernels.decode_attention(q, kc, vc, lengths, num_splits=num_splits, group=g["group"],
                                   q_offset=g["q_offset"], **scales)
    ref = decode_reference(q, kc, vc, lengths, head_map=head_map, **scales)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_a_head_map_that_does_not_fit_is_refused_naming_it(kernels):
    kc = torch.zeros(1, 2, 8, 16)
    q = torch.zeros(1, 5, 16)
    with pytest.raises(ValueError, match=r"H \(5\) must be a multiple of the number of KV heads Hkv \(2\), or group"):
        kernels.decode_attention(q, kc, kc, torch.tensor([8]))
    with pytest.raises(ValueError, match="group 3 with q_offset 2 cannot map 5 query heads onto 2 KV heads"):
        kernels.decode_attention(q, kc, kc, torch.tensor([8]), group=3, q_offset=2)
    with pytest.raises(ValueError, match="q_offset in 0..group-1, got group 3, q_offset 3"):
        kernels.decode_attention(q, kc, kc, torch.tensor([8]), group=3, q_offset=3)
    with pytest.raises(ValueError, match="q_offset must be a non-negative integer, got -1"):
        kernels.decode_attention(q, kc, kc, torch.tensor([8]), group=3, q_offset=-1)
    assert kernels.decode_attention(q, kc, kc, torch.tensor([8]), group=3).shape == (1, 5, 16)


@given(
    lmax=st.integers(1, 300),
    splits=st.integers(1, 12),
    ratio=st.sampled_from([1, 4]),
    dtype=st.sampled_from(CACHE_DTYPES),
)
def test_split_kv_matches_unsplit(kernels, lmax, splits, ratio, dtype):
    """Split-KV (partial softmax statistics merged afterwards) equals one pass, including
    splits left empty because a sequence is shorter than the split count."""
    gen = torch.Generator().manual_seed(lmax)
    _, _, kc, vc, scales = build_cache(kernels, 3, 2, lmax, 64, dtype, gen)
    q = torch.randn(3, 2 * ratio, 64, generator=gen)
    lengths = torch.tensor([1, max(1, lmax // 2), lmax])
    one = kernels.decode_attention(q, kc, vc, lengths, num_splits=1, **scales)
    many = kernels.decode_attention(q, kc, vc, lengths, num_splits=splits, **scales)
    torch.testing.assert_close(many, one, atol=1e-5, rtol=1e-5)


@given(
    L=st.integers(1, 600),
    D=st.sampled_from([64, 128, 80]),
    ratio=st.sampled_from([1, 4]),
    spread=st.sampled_from([0.01, 1.0, 30.0]),
)
def test_int8_cache_error_within_quantization_bound(kernels, L, D, ratio, spread):
    """|o_int8 - o_fp32| is bounded by what the per-token quantization error allows.

    Each K element moves by at most s_t / 2, so score t moves by at most
    delta_t = scale * ||q||_1 * s_t / 2; with delta = max_t delta_t every probability
    moves by a factor within exp(+-2 delta), so ||p' - p||_1 <= exp(2 delta) - 1.
    Each V element moves by at most s^v_t / 2. Hence
        |o' - o| <= (exp(2 delta) - 1) * max|v| + max_t s^v_t / 2   (+ fp32 rounding).
    """
    gen = torch.Generator().manual_seed(L * 7 + D)
    B, Hkv = 2, 2
    k = torch.randn(B, Hkv, L, D, generator=gen) * spread
    v = torch.randn(B, Hkv, L, D, generator=gen) * spread
    kc, ks = kernels.quantize_kv_int8(k)
    vc, vs = kernels.quantize_kv_int8(v)
    q = torch.randn(B, Hkv * ratio, D, generator=gen)
    lengths = torch.full((B,), L)
    out8 = kernels.decode_attention(q, kc, vc, lengths, k_scale=ks, v_scale=vs).double()
    out32 = kernels.decode_attention(q, k, v, lengths).double()

    sm = 1.0 / math.sqrt(D)
    q1 = q.abs().sum(-1).double()  # [B, H]
    ks_h = ks.double().repeat_interleave(ratio, dim=1)  # [B, H, L]
    delta = (sm * q1.unsqueeze(-1) * ks_h / 2).amax(-1)  # [B, H]
    bound = torch.expm1(2 * delta) * v.abs().amax().double() + vs.double().amax() / 2
    err = (out8 - out32).abs().amax(-1)  # [B, H]
    assert torch.all(err <= bound * 1.001 + 1e-5), (err / bound).max()


@given(c=decode_case())
def test_int8_query_within_the_query_quantization_bound(kernels, c):
    """The integer-dot kernel (int8_kernel="dot") against the float64 reference over the same int8
    cache. Its one extra rounding is the query's: each q element moves by at most
    q_scale / 2 (q_scale = max|q_h| / 127), so score t moves by at most
    delta_t = scale * q_scale / 2 * ||k_t||_1 (k_t as stored, times its scale) and
        |o' - o| <= (exp(2 max_t delta_t) - 1) * max|v|   (+ fp32 rounding)."""
    gen = torch.Generator().manual_seed(c["seed"])
    B, Hkv, Lmax, D, ratio = c["B"], c["Hkv"], c["Lmax"], c["D"], c["ratio"]
    H = Hkv * ratio
    _, _, kc, vc, scales = build_cache(kernels, B, Hkv, Lmax, D, torch.int8, gen)
    q = torch.randn(B, H, D, generator=gen)
    lengths = torch.randint(1, Lmax + 1, (B,), generator=gen) if c["ragged"] else torch.full((B,), Lmax)
    out = kernels.decode_attention(q, kc, vc, lengths, num_splits=c["num_splits"], int8_kernel="dot", **scales)
    ref = decode_reference(q, kc, vc, lengths, **scales)
    k = (kc.double() * scales["k_scale"].double().unsqueeze(-1)).repeat_interleave(ratio, dim=1)  # [B, H, L, D]
    v = vc.double() * scales["v_scale"].double().unsqueeze(-1)
    q_scale = q.double().abs().amax(-1) / 127  # [B, H]
    delta = (q_scale.unsqueeze(-1) / 2 * k.abs().sum(-1)).amax(-1) / math.sqrt(D)  # [B, H]
    bound = torch.expm1(2 * delta) * v.abs().amax()
    err = (out.double() - ref).abs().amax(-1)
    assert torch.all(err <= bound * 1.001 + 1e-5 + 1e-5 * ref.abs().amax(-1)), (err / bound).max()


def test_int8_query_is_exact_when_the_query_is_representable(kernels):
    """A query whose every head is already c * (integers in [-127, 127]) with a +-127 in it
    loses nothing to quantization: the integer path then equals the reference."""
    gen = torch.Generator().manual_seed(5)
    for D, ratio in ((64, 3), (20, 1), (130, 4)):
        _, _, kc, vc, scales = build_cache(kernels, 2, 2, 77, D, torch.int8, gen)
        q8 = torch.randint(-127, 128, (2, 2 * ratio, D), generator=gen)
        q8[..., 0] = 127
        q = q8.float() * 0.013
        lengths = torch.tensor([77, 31])
        out = kernels.decode_attention(q, kc, vc, lengths, int8_kernel="dot", **scales)
        torch.testing.assert_close(out.double(), decode_reference(q, kc, vc, lengths, **scales), atol=1e-5,
                                   rtol=1e-5)


def test_int8_query_needs_an_int8_cache(kernels):
    import pytest

    kc = torch.zeros(1, 1, 8, 16)
    with pytest.raises(ValueError, match="int8_kernel 'dot' needs an int8 cache"):
        kernels.decode_attention(torch.zeros(1, 1, 16), kc, kc, torch.tensor([8]), int8_kernel="dot")
    with pytest.raises(TypeError, match="int8_kernel must be one of widen, dot, tile"):
        kernels.decode_attention(torch.zeros(1, 1, 16), kc, kc, torch.tensor([8]), int8_kernel=True)
    with pytest.raises(ValueError, match="int8_kernel must be one of widen, dot, tile, got 'fast'"):
        kernels.decode_attention(torch.zeros(1, 1, 16), kc, kc, torch.tensor([8]), int8_kernel="fast")


def test_decode_attends_only_within_length(kernels):
    """Tokens past a sequence's length, garbage or not, do not change its output."""
    q = torch.randn(2, 4, 64)
    k = torch.randn(2, 2, 50, 64)
    v = torch.randn(2, 2, 50, 64)
    lengths = torch.tensor([20, 50])
    out = kernels.decode_attention(q, k, v, lengths)
    k[0, :, 20:] = 1e4
    v[0, :, 20:] = float("nan")
    out2 = kernels.decode_attention(q, k, v, lengths)
    assert torch.equal(out, out2)


def test_default_splits_leave_no_thread_idle():
    """The fewest splits whose equal tasks fill whole rounds of the threads to within 10%."""
    from workbench.kernels import native

    threads = torch.get_num_threads()
    assert native.default_num_splits(1, 1, 4096) >= min(threads, 16)
    assert native.default_num_splits(64, 32, 4096) == 1
    assert native.default_num_splits(1, 1, 100) == 1  # too short to be worth splitting
    for B, Hkv in ((1, 3), (1, 8), (2, 3), (1, 32), (4, 5)):
        splits = native.default_num_splits(B, Hkv, 1 << 16)
        tasks = B * Hkv * splits
        assert -(-tasks // threads) * threads <= 1.1 * tasks, (B, Hkv, splits)
        fewer = B * Hkv * (splits - 1)
        assert splits == 1 or -(-fewer // threads) * threads > 1.1 * fewer, (B, Hkv, splits)


# -- the tiled int8 layout: integer scores and integer P.V (kernels/decode_tiled.cpp) ---------


def build_tiled(kernels, B, Hkv, Lmax, D, gen, spread=1.0):
    """Random K/V written twice through the append kernel: token rows (for the reference) and
    the tiled layout (Lmax rounded up to whole 32-token blocks), with the same scales."""
    from workbench.kernels import TILED_ALIGN

    stored = -(-Lmax // TILED_ALIGN) * TILED_ALIGN
    k = torch.randn(B, Hkv, Lmax, D, generator=gen) * spread
    v = torch.randn(B, Hkv, Lmax, D, generator=gen) * spread
    rows = {n: torch.zeros(B, Hkv, Lmax, D, dtype=torch.int8) for n in ("k", "v")}
    tiles = {n: torch.zeros(B, Hkv, stored, D, dtype=torch.int8) for n in ("k", "v")}
    scales = {n: torch.zeros(B, Hkv, Lmax) for n in ("k_scale", "v_scale")}
    tiled_scales = {n: torch.zeros(B, Hkv, stored) for n in ("k_scale", "v_scale")}
    start = torch.zeros(B, dtype=torch.int64)
    for name, x, layout in (("k", k, "k_tiles"), ("v", v, "v_groups")):
        kernels.kv_cache_append(rows[name], x, start, scales=scales[f"{name}_scale"])
        kernels.kv_cache_append(tiles[name], x, start, scales=tiled_scales[f"{name}_scale"], layout=layout)
    return rows, scales, tiles, tiled_scales


def tiled_bound(q, rows, scales, lengths, ratio):
    """What the tiled kernel may differ from the float64 reference over the same cache.

    Its query rounding moves each score by at most delta (as for int8_kernel="dot"), so every
    probability by a factor within exp(+-2 delta): (exp(2 delta) - 1) max|v|. Then P.V
    quantizes p'_t = p_t s^v_t per 32-token block b to ps_b * round(p'_t / ps_b), ps_b =
    max_b p' / 127: each p'_t moves by at most max_b p' / 254, against |v8| <= 127, so the
    output moves by at most 0.5 * sum_b n_b max_{t in b} pi'_t (pi' the normalised p'),
    with pi' at most exp(2 delta) times the reference's."""
    B, H, D = q.shape
    k = (rows["k"].double() * scales["k_scale"].double().unsqueeze(-1)).repeat_interleave(ratio, dim=1)
    v = rows["v"].double() * scales["v_scale"].double().unsqueeze(-1)
    vs = scales["v_scale"].double().repeat_interleave(ratio, dim=1)  # [B, H, L]
    q_scale = q.double().abs().amax(-1) / 127
    delta = (q_scale.unsqueeze(-1) / 2 * k.abs().sum(-1)).amax(-1) / math.sqrt(D)  # [B, H]
    bound = torch.empty(B, H, dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        s = torch.einsum("hd,hnd->hn", q[b].double(), k[b, :, :n]) / math.sqrt(D)
        pi = torch.softmax(s, -1) * vs[b, :, :n]  # [H, n]
        blocks = torch.nn.functional.pad(pi, (0, -n % 32)).reshape(H, -1, 32)
        counts = torch.full((blocks.shape[1],), 32.0, dtype=torch.float64)
        counts[-1] = n - 32 * (blocks.shape[1] - 1)
        p_part = 0.5 * (blocks.amax(-1) * counts).sum(-1)
        bound[b] = torch.expm1(2 * delta[b]) * v[b].abs().amax() + torch.exp(2 * delta[b]) * p_part
    return bound


@st.composite
def tiled_case(draw):
    return dict(
        B=draw(st.integers(1, 3)),
        Hkv=draw(st.integers(1, 3)),
        ratio=draw(st.sampled_from([1, 3, 4, 5, 8, 12])),
        Lmax=draw(st.integers(1, 300)),
        D=draw(st.sampled_from([64, 128, 80, 72, 20, 4])),
        num_splits=draw(st.one_of(st.none(), st.integers(1, 9))),
        ragged=draw(st.booleans()),
        spread=draw(st.sampled_from([0.05, 1.0, 8.0])),
        seed=draw(st.integers(0, 2**16)),
    )


@given(c=tiled_case())
def test_tiled_within_the_query_and_probability_bound(kernels, c):
    gen = torch.Generator().manual_seed(c["seed"])
    B, Hkv, Lmax, D, ratio = c["B"], c["Hkv"], c["Lmax"], c["D"], c["ratio"]
    rows, scales, tiles, tiled_scales = build_tiled(kernels, B, Hkv, Lmax, D, gen, c["spread"])
    q = torch.randn(B, Hkv * ratio, D, generator=gen)
    lengths = torch.randint(1, Lmax + 1, (B,), generator=gen) if c["ragged"] else torch.full((B,), Lmax)
    out = kernels.decode_attention(q, tiles["k"], tiles["v"], lengths, num_splits=c["num_splits"], int8_kernel="tile",
                                   **tiled_scales)
    ref = decode_reference(q, rows["k"], rows["v"], lengths, **scales)
    bound = tiled_bound(q, rows, scales, lengths, ratio)
    err = (out.double() - ref).abs().amax(-1)
    assert torch.all(err <= bound * 1.001 + 1e-5 + 1e-5 * ref.abs().amax(-1)), (err / bound).max()


@given(B=st.integers(1, 3), Hkv=st.integers(1, 3), Lmax=st.integers(1, 200), D=st.sampled_from([4, 20, 64, 128]),
       T=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_tiled_appends_hold_the_row_layouts_bytes(kernels, B, Hkv, Lmax, D, T, seed):
    """Appends at ragged positions into the tiled layout, read back by untile_kv, are the row
    layout's bytes and scales exactly."""
    from workbench.kernels import TILED_ALIGN, untile_kv

    gen = torch.Generator().manual_seed(seed)
    T = min(T, Lmax)
    stored = -(-Lmax // TILED_ALIGN) * TILED_ALIGN
    x = torch.randn(B, Hkv, T, D, generator=gen)
    pos = torch.randint(0, Lmax - T + 1, (B,), generator=gen)
    rows, rs = torch.zeros(B, Hkv, stored, D, dtype=torch.int8), torch.zeros(B, Hkv, stored)
    kernels.kv_cache_append(rows, x, pos, scales=rs)
    for layout in ("k_tiles", "v_groups"):
        tiles, ts = torch.zeros(B, Hkv, stored, D, dtype=torch.int8), torch.zeros(B, Hkv, stored)
        kernels.kv_cache_append(tiles, x, pos, scales=ts, layout=layout)
        assert torch.equal(untile_kv(tiles, layout), rows) and torch.equal(ts, rs)


def test_tiled_is_exact_when_nothing_is_rounded(kernels):
    """Uniform attention (all-zero K) over V rows that share one scale quantizes every
    probability to exactly 127: the integer P.V then equals the reference (the mean of v)."""
    gen = torch.Generator().manual_seed(3)
    B, Hkv, L, D = 2, 2, 77, 64
    v = torch.randint(-126, 127, (B, Hkv, L, D), generator=gen).float()
    v[..., 0] = 127  # every row's max |v| is 127: scale 1, stored exactly
    k = torch.zeros(B, Hkv, L, D)
    tiles = {n: torch.zeros(B, Hkv, 96, D, dtype=torch.int8) for n in ("k", "v")}
    sc = {n: torch.zeros(B, Hkv, 96) for n in ("k_scale", "v_scale")}
    start = torch.zeros(B, dtype=torch.int64)
    kernels.kv_cache_append(tiles["k"], k, start, scales=sc["k_scale"], layout="k_tiles")
    kernels.kv_cache_append(tiles["v"], v, start, scales=sc["v_scale"], layout="v_groups")
    q = torch.randn(B, 3 * Hkv, D, generator=gen)
    lengths = torch.tensor([77, 45])
    for splits in (1, 2, 3):
        out = kernels.decode_attention(q, tiles["k"], tiles["v"], lengths, int8_kernel="tile", num_splits=splits, **sc)
        for b in range(B):
            want = v[b, :, : int(lengths[b])].double().mean(1).repeat_interleave(3, dim=0)
            torch.testing.assert_close(out[b].double(), want, atol=1e-5, rtol=1e-5)


def test_tiled_ignores_whatever_lies_past_each_length(kernels):
    gen = torch.Generator().manual_seed(4)
    rows, scales, tiles, sc = build_tiled(kernels, 2, 2, 70, 64, gen)
    q = torch.randn(2, 6, 64, generator=gen)
    lengths = torch.tensor([20, 70])
    out = kernels.decode_attention(q, tiles["k"], tiles["v"], lengths, int8_kernel="tile", **sc)
    junk = torch.randn(2, 2, 96 - 20, 64, generator=gen) * 50
    junk_sc = {n: torch.zeros_like(s) for n, s in sc.items()}
    for name, layout in (("k", "k_tiles"), ("v", "v_groups")):
        kernels.kv_cache_append(tiles[name][:1], junk[:1], torch.tensor([20]), scales=junk_sc[f"{name}_scale"][:1],
                                layout=layout)
    sc["k_scale"][0, :, 20:] = float("inf")
    sc["v_scale"][0, :, 20:] = float("nan")
    again = kernels.decode_attention(q, tiles["k"], tiles["v"], lengths, int8_kernel="tile", **sc)
    assert torch.equal(out, again)


def test_tiled_rejects_what_it_cannot_read(kernels):
    import pytest

    i8 = torch.zeros(1, 1, 64, 16, dtype=torch.int8)
    s = dict(k_scale=torch.zeros(1, 1, 64), v_scale=torch.zeros(1, 1, 64))
    q = torch.zeros(1, 1, 16)
    with pytest.raises(ValueError, match="int8_kernel 'tile' needs an int8 cache"):
        kernels.decode_attention(q, i8.float(), i8.float(), torch.tensor([8]), int8_kernel="tile")
    odd = torch.zeros(1, 1, 40, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="Lmax to be a multiple of 32, got 40"):
        kernels.decode_attention(q, odd, odd, torch.tensor([8]), int8_kernel="tile", k_scale=torch.zeros(1, 1, 40),
                                 v_scale=torch.zeros(1, 1, 40))
    d18 = torch.zeros(1, 1, 64, 18, dtype=torch.int8)
    with pytest.raises(ValueError, match="head dim D to be a multiple of 4, got 18"):
        kernels.kv_cache_append(d18, torch.zeros(1, 1, 1, 18), torch.tensor([0]), scales=s["k_scale"],
                                layout="k_tiles")
    with pytest.raises(ValueError, match="layout must be one of rows, k_tiles, v_groups, got 'tiles'"):
        kernels.kv_cache_append(i8, torch.zeros(1, 1, 1, 16), torch.tensor([0]), scales=s["k_scale"], layout="tiles")
    with pytest.raises(ValueError, match="layout 'k_tiles' needs an int8 cache"):
        kernels.kv_cache_append(i8.float(), torch.zeros(1, 1, 1, 16), torch.tensor([0]), layout="k_tiles")
    with pytest.raises(TypeError, match="int8_kernel must be one of"):
        kernels.decode_attention(q, i8, i8, torch.tensor([8]), int8_kernel=1, **s)


def test_the_kv_kernels_are_the_cpp_enums():
    """kv_formats.KV_KERNELS names the C++ side's Int8Kernel values, in its order."""
    from workbench import kernels as ks
    from workbench.model.kv_formats import KV_KERNELS

    assert list(KV_KERNELS) == ks.constants()["int8_kernels"]
