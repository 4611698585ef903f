"""The switches a generation runs with, checked against the registries: which attention
backend (workbench.model.attention), which KV-cache format and which kernel reads it
(workbench.model.kv_formats), and which path runs a decode step (STEP_PATHS). Changing them
never touches the weights."""

from __future__ import annotations

from dataclasses import dataclass

from workbench.model.attention import attention_backend
from workbench.model.kv_formats import kv_format, kv_label


# How a decode step runs. "fused" applies where every piece has a C++ kernel (the slim / flash
# backends, a kernel KV format, one process); elsewhere the step runs the reference path.
STEP_PATHS = {
    "fused": "one C++ call per step runs every layer (kernels/decode_step.cpp), GIL released",
    "reference": "the readable Python model (workbench/model/llama.py): one kernel call per operation",
}


@dataclass(frozen=True)
class Switches:
    attention: str = "slim"
    kv_cache: str = "fp32"
    kv_kernel: str | None = None  # how the cache is read (KV_KERNELS); None: the format's default
    step: str = "fused"

    def __post_init__(self):
        attention_backend(self.attention)  # each raises a ValueError naming the accepted values
        kv_format(self.kv_cache).kernel(self.kv_kernel)
        if self.step not in STEP_PATHS:
            raise ValueError(f"step must be one of {', '.join(STEP_PATHS)}, got {self.step!r}")

    @property
    def kv_text(self) -> str:
        """The cache as tables name it: "int8 (tile)", "fp16" (kv_formats.kv_label)."""
        return kv_label(self.kv_cache, self.kv_kernel)
