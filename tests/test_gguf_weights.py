"""Quantized GGUF files load in their own formats, as a user's file would: the bundled model's
Q4_1 blocks, and the bundled model requantized by our quantizer into llama.cpp's Q4_K_M mix
(Q4_K, Q6_K, and the Q5_0 / Q8_0 fallbacks its 576-wide rows take), tensor by tensor as the
file has them; dtype= still converts; bad files and loads that would not fit are clear errors,
the previous model kept."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import gguf
import numpy as np
import pytest
import torch

import workbench as wb
from gguf_edit import copy_gguf
from workbench.model.gguf_file import read_gguf
from workbench.model.loaders import ModelLoadError, bundled_gguf_path
from workbench.model.quantize import MIXES, tensor_format, use_more_bits, write_quantized


@pytest.fixture(scope="session")
def q4_k_m(tmp_path_factory):
    """The bundled model as a Q4_K_M file, made by our quantizer."""
    return write_quantized(bundled_gguf_path(), tmp_path_factory.mktemp("gguf") / "smollm2-q4_k_m.gguf", "Q4_K_M")


def test_our_q4_k_m_mix_is_llama_cpps(q4_k_m):
    """Q4_K where rows are whole super-blocks (ffn_down: 1536 wide), Q6_K for ffn_down in the
    layers llama.cpp gives more bits, Q5_0 / Q8_0 where Q4_K / Q6_K cannot hold a 576-wide row,
    the tied table as the LM head (Q6_K -> Q8_0), norms F32."""
    f = read_gguf(q4_k_m)
    kinds = {name: t.tensor_type.name for name, t in f.tensors.items()}
    more = [i for i in range(30) if use_more_bits(i, 30)]
    assert more == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    for i in range(30):
        assert kinds[f"blk.{i}.ffn_down.weight"] == ("Q6_K" if i in more else "Q4_K")
        assert kinds[f"blk.{i}.attn_v.weight"] == ("Q8_0" if i in more else "Q5_0")
        assert kinds[f"blk.{i}.attn_q.weight"] == kinds[f"blk.{i}.ffn_up.weight"] == "Q5_0"
        assert kinds[f"blk.{i}.attn_norm.weight"] == "F32"
    assert kinds["token_embd.weight"] == "Q8_0"
    assert int(f.fields["general.file_type"]) == MIXES["Q4_K_M"].file_type
    assert tensor_format(MIXES["Q4_K_M"], "blk.5.ffn_down.weight", 11008, 32, False).name == "q4_k"


def test_a_quantized_file_loads_in_its_own_formats(q4_k_m):
    model = wb.load_model(str(q4_k_m))
    formats = model.llama.weight_formats
    assert model.weight_dtype == "file"
    assert formats["down"] == {"q6_k": 14, "q4_k": 16}
    assert formats["qkv"] == {"q5_0": 30, "q8_0": 14}  # v in its own format: two parts in those layers
    assert formats["lm_head"] == formats["embedding"] == {"q8_0": 1}  # tied: one table
    assert model.llama.embedding_shared
    f = read_gguf(q4_k_m)
    layers = sum(t.nbytes for n, t in f.tensors.items() if n.startswith("blk.") and len(t.shape) == 2)
    assert sum(layer.weight_bytes for layer in model.llama.layers) == layers + 4 * 2 * 576 * 30  # + fp32 norms
    bundled = wb.load_model("smollm2-135m")
    assert bundled.llama.weight_formats["down"] == {"q4_1": 30}  # the shipped file: Q4_1, a Q8_0 table


def test_its_logits_are_the_files_exact_values(q4_k_m):
    """The file's blocks as they are against the same file dequantized to fp32 (the exact values
    the blocks encode), teacher-forced through decode steps on real text (the matrix-vector
    kernels, where the block products round the activations to int16: kernels/blocks.cpp; a
    prefill's GEMM dequantizes to fp32 and is exact): the logits agree to a few parts in 10^3
    (measured 1.2e-3) and the greedy tokens are the same."""
    from workbench.analysis.forcing import forced_logits
    from workbench.model.switches import Switches

    text = open("/usr/share/common-licenses/Apache-2.0").read()[:2000]
    blocks, exact = wb.load_model(str(q4_k_m)), wb.load_model(str(q4_k_m), dtype="fp32")
    ids = blocks.tokenizer.encode(text)[:80]
    follow = torch.tensor([ids[1:]])
    la, lb = (forced_logits(m.llama, [ids[:1]], follow, Switches("slim", "fp32"))[0] for m in (blocks, exact))
    rel = ((la - lb).abs().max() / lb.abs().max()).item()
    agree = (la.argmax(-1) == lb.argmax(-1)).float().mean().item()
    assert rel < 1e-2 and agree >= 0.97, (rel, agree)
    out_a = blocks.generate("The capital of France is", max_new_tokens=16)
    out_b = exact.generate("The capital of France is", max_new_tokens=16)
    assert out_a.token_ids == out_b.token_ids


def test_dtype_still_converts(q4_k_m):
    for dtype in ("bf16", "int8-g32", "q8_0", "int4-g32"):
        model = wb.load_model(str(q4_k_m), dtype=dtype)
        fmts = {name for group in model.llama.weight_formats.values() for name in group}
        expected = {dtype, "bfloat16", "float32"} if dtype in ("bf16", "int8-g32") else {dtype}
        assert fmts <= expected, (dtype, fmts)
        assert len(model.generate("Hello", max_new_tokens=3).token_ids) == 3


def _write(path, tensors: dict, fields: dict | None = None):
    w = gguf.GGUFWriter(path, "llama")
    for k, v in (fields or {}).items():
        w.add_key_value(k, v, gguf.GGUFValueType.UINT32)
    for name, (data, raw) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _copy_with(src, out, replace: dict):
    """src's metadata and tensors, with tensors in `replace` swapped for (data, raw type)."""
    return copy_gguf(src, out, lambda name, data, kind: replace.get(name, (data, kind)))


def test_a_type_the_kernels_cannot_read_is_named_and_converts_when_asked(tmp_path, q4_k_m):
    """A Q2_K tensor (a type the kernels do not read): the default load names the tensor and its
    type; dtype='fp32' converts it (the gguf package decodes it), and nothing is silently kept."""
    f = read_gguf(q4_k_m)
    t = f.tensors["blk.3.ffn_down.weight"]  # Q4_K, 576 x 1536: as Q2_K, 84 bytes per 256
    rows = t.shape[1]
    q2 = np.random.default_rng(0).integers(0, 255, (rows, 1536 // 256 * 84), dtype=np.uint8)
    q2.reshape(rows, -1, 84)[:, :, 80:84] = np.frombuffer(np.float16([0.01, 0.001]).tobytes(), np.uint8)  # d, dmin
    path = _copy_with(q4_k_m, tmp_path / "q2.gguf", {"blk.3.ffn_down.weight": (q2, gguf.GGMLQuantizationType.Q2_K)})
    with pytest.raises(ModelLoadError, match=r"blk\.3\.ffn_down\.weight is Q2_K, a type the workbench cannot read"):
        wb.load_model(str(path))
    model = wb.load_model(str(path), dtype="fp32")
    assert model.llama.weight_formats["down"] == {"fp32": 30}


def test_a_truncated_file_is_a_clear_error(tmp_path, q4_k_m):
    data = q4_k_m.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100_000])
    with pytest.raises(ModelLoadError, match=r"runs past the end of the file .*truncated"):
        wb.load_model(str(cut))


def test_a_load_that_would_not_fit_is_refused_with_its_own_peak_counted(monkeypatch, q4_k_m):
    """The estimate counts what the load holds while it converts (a matrix dequantized to fp32
    and its result), and the refusal names the bytes needed and available; no model is built."""
    from workbench.model import loaders

    monkeypatch.setattr(loaders, "available_memory_bytes", lambda: 150 << 20)
    with pytest.raises(ModelLoadError, match=r"needs about .* GiB more .* GiB the load holds while it converts.*"
                                             r"only 0\.1 GiB is available"):
        wb.load_model(str(q4_k_m), dtype="int8-g32")
    with pytest.raises(ModelLoadError, match="only 0.1 GiB is available"):
        wb.load_model(str(q4_k_m))


def test_loading_holds_about_the_files_bytes(q4_k_m):
    """In a fresh process, loading the Q4_K_M file adds about its own size to the resident set
    (the blocks copied once into the model's arena, the file's pages released as they are
    copied), never an fp32 copy of the model (which would be 4x the file here)."""
    code = f"""
import json, resource, workbench as wb
from workbench import kernels
kernels.native.ext
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
m = wb.load_model({str(q4_k_m)!r})
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"peak_growth": (after - before) * 1024, "weights": m.llama.weight_bytes}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout.strip().splitlines()[-1])
    size = q4_k_m.stat().st_size
    assert r["peak_growth"] < size + (48 << 20), (r, size)  # + what the load holds at once (tokenizer, a layer)
    assert r["weights"] < 1.1 * size
