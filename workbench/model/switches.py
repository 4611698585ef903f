"""The switches a generation runs with, checked against the registries: which attention
backend (workbench.model.attention), which KV-cache format (workbench.model.kv_formats) and
which decode path (DECODE_PATHS). Changing them never touches the weights."""

from __future__ import annotations

from dataclasses import dataclass

from workbench.model.attention import attention_backend
from workbench.model.kv_formats import kv_format


# How a decode step runs. "fused" applies where every piece has a C++ kernel (the slim / flash
# backends, a kernel KV format, one process); elsewhere the step runs the Python path.
DECODE_PATHS = {
    "fused": "one C++ call per step runs every layer (kernels/decode_step.cpp), GIL released",
    "python": "the readable Python model (workbench/model/llama.py): one kernel call per operation",
}


@dataclass(frozen=True)
class Switches:
    attention: str = "slim"
    kv_cache: str = "fp32"
    decode: str = "fused"

    def __post_init__(self):
        attention_backend(self.attention)  # each raises a ValueError naming the accepted values
        kv_format(self.kv_cache)
        if self.decode not in DECODE_PATHS:
            raise ValueError(f"decode must be one of {', '.join(DECODE_PATHS)}, got {self.decode!r}")
