"""Our GGUF reader (workbench/model/gguf_file.py) against the gguf package's: the same fields
and the same tensor bytes, on the bundled model and on a file written here with every metadata
type and several tensor types; its own dequantization equals the package's; a damaged file is
a clear error, never a crash."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize

from workbench.model.gguf_file import GGUFError, dequantize, read_gguf
from workbench.model.loaders import bundled_gguf_path

Q = GGMLQuantizationType


def assert_same_as_the_package(path):
    ours, theirs = read_gguf(path), GGUFReader(str(path))
    names = [k for k in theirs.fields if not k.startswith("GGUF.")]  # the package's pseudo-fields
    assert sorted(names) == sorted(ours.fields)
    for key in names:
        expected = theirs.fields[key].contents()
        assert ours.fields[key] == expected and type(ours.fields[key]) is type(expected), key
        kinds = theirs.fields[key].types  # the value type, and an array's element type last
        assert ours.types[key] == (int(kinds[0]), int(kinds[-1]) if kinds[0] == GGUFValueType.ARRAY else None), key
    assert [t.name for t in theirs.tensors] == list(ours.tensors)
    for t in theirs.tensors:
        o = ours.tensors[t.name]
        assert o.tensor_type == t.tensor_type and o.shape == tuple(int(d) for d in t.shape), t.name
        assert o.data.dtype == t.data.dtype and o.data.shape == t.data.shape and np.array_equal(o.data, t.data)
        np.testing.assert_array_equal(dequantize(o), gguf_dequantize(t.data, t.tensor_type).astype(np.float32))
    return ours


def test_the_bundled_model_reads_as_the_package_reads_it():
    f = assert_same_as_the_package(bundled_gguf_path())
    assert {t.tensor_type.name for t in f.tensors.values()} == {"F32", "Q8_0", "Q4_1"}


def write_sample(path, rng):
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("sample.u32", 7)
    w.add_int32("sample.i32", -3)
    w.add_float32("sample.f32", 0.5)
    w.add_bool("sample.bool", True)
    w.add_string("sample.text", "héllo")
    w.add_uint64("sample.u64", 1 << 40)
    w.add_array("sample.ints", [1, 2, 3])
    w.add_array("sample.strings", ["a", "bc", ""])
    w.add_custom_alignment(64)
    tensors = {"f32": rng.standard_normal((3, 5)).astype(np.float32),
               "f16": rng.standard_normal((4, 7)).astype(np.float16),
               "q8": rng.standard_normal((2, 64)).astype(np.float32),
               "q4_1": rng.standard_normal((3, 96)).astype(np.float32)}
    w.add_tensor("f32", tensors["f32"])
    w.add_tensor("f16", tensors["f16"])
    for name, qtype in (("q8", Q.Q8_0), ("q4_1", Q.Q4_1)):
        w.add_tensor(name, quantize(tensors[name], qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def test_every_metadata_type_and_tensor_type_of_a_written_file(tmp_path):
    path = tmp_path / "sample.gguf"
    values = write_sample(path, np.random.default_rng(0))
    f = assert_same_as_the_package(path)
    assert f.fields["sample.strings"] == ["a", "bc", ""] and f.fields["sample.text"] == "héllo"
    assert f.fields["general.alignment"] == 64
    np.testing.assert_array_equal(dequantize(f.tensors["f32"]), values["f32"])
    np.testing.assert_array_equal(dequantize(f.tensors["f16"]), values["f16"].astype(np.float32))
    # Quantized: within half a step of the block's scale (Q8_0: max|x| / 127 per 32 values).
    q8 = values["q8"].reshape(-1, 32)
    err = np.abs(dequantize(f.tensors["q8"]).reshape(-1, 32) - q8)
    assert (err <= 0.51 * np.abs(q8).max(axis=1, keepdims=True) / 127 + 1e-3).all()


@pytest.mark.parametrize("damage", ["empty", "not gguf", "version 9", "truncated header", "truncated data"])
def test_a_damaged_file_is_a_clear_error(tmp_path, damage):
    path = tmp_path / "sample.gguf"
    write_sample(path, np.random.default_rng(1))
    raw = path.read_bytes()
    bad = {"empty": b"", "not gguf": b"GGML" + raw[4:], "version 9": raw[:4] + (9).to_bytes(4, "little") + raw[8:],
           "truncated header": raw[:100], "truncated data": raw[:-40]}[damage]
    path.write_bytes(bad)
    with pytest.raises(GGUFError, match=str(path)):
        read_gguf(path)
