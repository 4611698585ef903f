"""The tensor-parallel LM head's exchange (kernels.topk_pairs on each rank, kernels.merge_topk
on the gathered pairs) against a plain reference: every row's candidates sorted by (logit
descending, token id ascending), with ties drawn on purpose (a few distinct values), NaN
ranking first as in torch.topk, odd widths, one row and several, several ranks, and clear
errors for what does not fit."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st


def best(values, ids, k):
    """The k best (value, id) pairs: NaN first, then larger values, equal values by lower id."""
    def key(pair):
        v, i = pair
        return (0 if math.isnan(v) else 1, 0.0 if math.isnan(v) else -v, i)
    return sorted(zip(values, ids), key=key)[:k]


logit_rows = st.integers(1, 4).flatmap(lambda rows: st.integers(1, 700).flatmap(lambda n: st.tuples(
    st.just(rows), st.just(n), st.integers(1, min(n, 20)), st.integers(0, 1000),
    st.sampled_from(["normal", "ties", "nan"]))))


@given(case=logit_rows, offset=st.integers(0, 50_000))
def test_each_rows_best_k_best_first_ties_by_lower_id(kernels, case, offset):
    rows, n, k, seed, kind = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=gen, dtype=torch.float64)
    if kind == "ties":
        x = torch.randint(-3, 3, (rows, n), generator=gen).double()  # most logits equal to others
    elif kind == "nan":
        x[torch.rand(rows, n, generator=gen) < 0.05] = float("nan")
    out = kernels.topk_pairs(x.float(), k, offset)
    assert out.shape == (rows, 2 * k) and out.dtype == torch.float32
    for r in range(rows):
        want = best(x[r].float().tolist(), range(n), k)
        got_values, got_ids = out[r, :k].tolist(), out[r, k:].tolist()
        assert [i + offset for _, i in want] == got_ids
        assert [v for v, _ in want] == pytest.approx(got_values, nan_ok=True)


@given(world=st.integers(1, 4), rows=st.integers(1, 3), k=st.integers(1, 12), vocab_per_rank=st.integers(12, 400),
       seed=st.integers(0, 1000), ties=st.booleans())
def test_merging_every_ranks_pairs_gives_the_global_top_k(kernels, world, rows, k, vocab_per_rank, seed, ties):
    """Each rank's best k of its vocabulary slice, merged, is the best k of the whole row: the
    logits come out -inf but at exactly the global top k, with their values; its argmax is the
    whole row's argmax (the one process's greedy token)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = world * vocab_per_rank
    full = (torch.randint(-4, 4, (rows, vocab), generator=gen).float() if ties
            else torch.randn(rows, vocab, generator=gen))
    pairs = torch.stack([kernels.topk_pairs(full[:, w * vocab_per_rank:(w + 1) * vocab_per_rank].contiguous(), k,
                                            w * vocab_per_rank) for w in range(world)])
    logits = kernels.merge_topk(pairs, vocab)
    assert logits.shape == (rows, vocab)
    for r in range(rows):
        want = best(full[r].tolist(), range(vocab), k)
        kept = torch.isfinite(logits[r]).nonzero().flatten().tolist()
        assert sorted(kept) == sorted(i for _, i in want)
        assert all(logits[r, i] == full[r, i] for i in kept)
        assert int(logits[r].argmax()) == int(full[r].argmax())


def test_bad_input_is_refused_naming_it(kernels):
    with pytest.raises(ValueError, match=r"k must be in \[1, n\] = \[1, 5\], got 6"):
        kernels.topk_pairs(torch.zeros(2, 5), 6)
    with pytest.raises(ValueError, match="k must be a positive integer, got 0"):
        kernels.topk_pairs(torch.zeros(2, 5), 0)
    with pytest.raises(ValueError, match="offset must be an integer >= 0, got -1"):
        kernels.topk_pairs(torch.zeros(2, 5), 2, -1)
    with pytest.raises(ValueError, match="token ids travel as float32"):
        kernels.topk_pairs(torch.zeros(1, 5), 2, 2**24)
    with pytest.raises(TypeError, match="logits must be float32, got Double"):
        kernels.topk_pairs(torch.zeros(2, 5, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match=r"logits must be a 2-D tensor \[rows, n\]"):
        kernels.topk_pairs(torch.zeros(5), 2)
    pairs = kernels.topk_pairs(torch.arange(10.0).reshape(1, 10), 3, 0).unsqueeze(0)
    with pytest.raises(ValueError, match=r"holds token id 9, not an integer in \[0, 5\)"):
        kernels.merge_topk(pairs, 5)
    with pytest.raises(ValueError, match="last dimension must be 2k >= 2"):
        kernels.merge_topk(torch.zeros(1, 1, 3), 5)
    with pytest.raises(ValueError, match="vocab must be a positive integer, got 0"):
        kernels.merge_topk(pairs, 0)
