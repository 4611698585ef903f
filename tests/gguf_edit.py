"""A GGUF file copied with some tensors changed: what the loaders' error tests feed them."""

from __future__ import annotations

import gguf
import numpy as np

from workbench.model.gguf_file import read_gguf


def copy_gguf(src, out, change):
    """src's metadata and tensors into `out`, each tensor through change(name, data, type) ->
    (data, GGML type), or None to drop it. Returns out."""
    f = read_gguf(src)
    w = gguf.GGUFWriter(out, f.fields["general.architecture"])
    for name, value in f.fields.items():
        if name == "general.architecture":
            continue
        vtype, sub = f.types[name]
        w.add_key_value(name, value, gguf.GGUFValueType(vtype), sub_type=gguf.GGUFValueType(sub) if sub else None)
    for name, t in f.tensors.items():
        kept = change(name, np.array(t.data), t.tensor_type)
        if kept is not None:
            w.add_tensor(name, kept[0], raw_dtype=kept[1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
