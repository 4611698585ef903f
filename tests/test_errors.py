"""Every kind of bad input raises a Python exception that names the argument; none crashes.

Each case runs on the native build; the checks live in one place (kernels/ops.cpp),
before any pointer is formed, so they hold for every build.
"""

from __future__ import annotations

import pytest
import torch

import workbench.kernels as K

q4 = torch.randn(1, 4, 8, 64)
kv4 = torch.randn(1, 2, 8, 64)
qd = torch.randn(2, 4, 64)
cache = torch.randn(2, 2, 16, 64)
lengths = torch.tensor([3, 16])


def prefill_cases():
    f = K.slim_attention
    g = K.flash_attention
    return [
        ("rank", lambda: f(q4[0], kv4, kv4), ValueError, "q must be a 4-D tensor"),
        ("dtype", lambda: f(q4.double(), kv4.double(), kv4.double()), TypeError, "float32 or bfloat16"),
        ("mixed dtype", lambda: f(q4, kv4.bfloat16(), kv4), TypeError, "same dtype"),
        ("device", lambda: f(q4.to("meta"), kv4, kv4), ValueError, "CPU tensor"),
        ("gqa ratio", lambda: f(torch.randn(1, 3, 8, 64), kv4, kv4), ValueError, "multiple of the number of KV heads"),
        ("head dim", lambda: f(q4, torch.randn(1, 2, 8, 32), torch.randn(1, 2, 8, 32)), ValueError, "head dim"),
        ("batch", lambda: f(q4, torch.randn(2, 2, 8, 64), torch.randn(2, 2, 8, 64)), ValueError, "batch"),
        ("k vs v", lambda: f(q4, kv4, torch.randn(1, 2, 9, 64)), ValueError, "same shape"),
        ("causal keys", lambda: f(q4, kv4[:, :, :4].contiguous(), kv4[:, :, :4].contiguous()), ValueError, "Nk"),
        ("non-contiguous", lambda: f(q4.transpose(2, 3), kv4, kv4), ValueError, "contiguous"),
        ("block_m", lambda: f(q4, kv4, kv4, block_m=0), ValueError, "block_m"),
        ("block_n", lambda: g(q4, kv4, kv4, block_n=-3), ValueError, "block_n"),
        ("scale", lambda: f(q4, kv4, kv4, scale=-1.0), ValueError, "scale"),
        ("scale nan", lambda: g(q4, kv4, kv4, scale=float("nan")), ValueError, "scale"),
        ("not a tensor", lambda: f([1, 2], kv4, kv4), TypeError, "q must be a torch.Tensor"),
    ]


def decode_cases():
    d = K.decode_attention
    c8, s8 = K.quantize_kv_int8(cache)
    return [
        ("q rank", lambda: d(q4, cache, cache, lengths), ValueError, "q must be a 3-D tensor"),
        ("cache rank", lambda: d(qd, cache[0], cache[0], lengths), ValueError, "k_cache must be a 4-D"),
        ("cache dtype", lambda: d(qd, cache.double(), cache.double(), lengths), TypeError, "int8, float16, bfloat16"),
        ("k/v dtype", lambda: d(qd, cache, cache.half(), lengths), TypeError, "same dtype"),
        ("k/v shape", lambda: d(qd, cache, cache[:, :, :8].contiguous(), lengths), ValueError, "same shape"),
        ("gqa ratio", lambda: d(torch.randn(2, 3, 64), cache, cache, lengths), ValueError, "multiple"),
        ("length 0", lambda: d(qd, cache, cache, torch.tensor([0, 3])), ValueError, "lengths"),
        ("length > Lmax", lambda: d(qd, cache, cache, torch.tensor([3, 17])), ValueError, "[1, 16]"),
        ("lengths count", lambda: d(qd, cache, cache, torch.tensor([3])), ValueError, "one entry per sequence"),
        ("lengths dtype", lambda: d(qd, cache, cache, torch.tensor([3.0, 4.0])), TypeError, "int32 or int64"),
        ("int8 without scales", lambda: d(qd, c8, c8, lengths), ValueError, "k_scale and v_scale"),
        ("scales shape", lambda: d(qd, c8, c8, lengths, k_scale=s8[:, :, :4], v_scale=s8), ValueError, "k_scale"),
        ("scales dtype", lambda: d(qd, c8, c8, lengths, k_scale=s8.double(), v_scale=s8), TypeError, "float32"),
        ("scales for fp32", lambda: d(qd, cache, cache, lengths, k_scale=s8, v_scale=s8), ValueError, "only used"),
        ("non-contiguous cache", lambda: d(qd, cache.transpose(2, 3), cache, lengths), ValueError, "contiguous"),
        ("num_splits", lambda: d(qd, cache, cache, lengths, num_splits=0), ValueError, "num_splits"),
    ]


def cache_cases():
    new = torch.randn(2, 2, 3, 64)
    pos = torch.tensor([0, 5])
    c8 = torch.zeros(2, 2, 16, 64, dtype=torch.int8)
    return [
        ("overflow", lambda: K.kv_cache_append(cache, new, torch.tensor([0, 14])), ValueError, "positions"),
        ("negative", lambda: K.kv_cache_append(cache, new, torch.tensor([-1, 0])), ValueError, "positions"),
        ("shape", lambda: K.kv_cache_append(cache, torch.randn(2, 3, 3, 64), pos), ValueError, "values must have shape"),
        ("int8 no scales", lambda: K.kv_cache_append(c8, new, pos), ValueError, "scales"),
        ("scales on fp32", lambda: K.kv_cache_append(cache, new, pos, scales=torch.zeros(2, 2, 16)), ValueError, "only used"),
        ("cache dtype", lambda: K.kv_cache_append(cache.double(), new, pos), TypeError, "cache must be int8"),
        ("quantize dtype", lambda: K.quantize_kv_int8(torch.arange(64)), TypeError, "float32, bfloat16"),
        ("quantize scalar", lambda: K.quantize_kv_int8(torch.tensor(1.0)), ValueError, "last dimension"),
        ("dequantize", lambda: K.dequantize_kv_int8(torch.zeros(2, 64), torch.ones(2)), TypeError, "int8"),
    ]


@pytest.mark.parametrize("name,call,exc,message", prefill_cases() + decode_cases() + cache_cases(),
                         ids=lambda x: x if isinstance(x, str) else "")
def test_bad_input_raises_clear_error(name, call, exc, message):
    with pytest.raises(exc) as info:
        call()
    assert message in str(info.value), str(info.value)
    # One line the user can read, not a C++ backtrace.
    assert "Exception raised from" not in str(info.value)
