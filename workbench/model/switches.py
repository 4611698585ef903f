"""The switches a generation runs with, checked against the registries: which attention
backend (workbench.model.attention), which KV-cache format and which kernel reads it
(workbench.model.kv_formats), and which path runs a decode step (STEP_PATHS). Changing them
never touches the weights."""

from __future__ import annotations

from dataclasses import dataclass, replace

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

    def overridden(self, attention: str | None = None, kv_cache: str | None = None, kv_kernel: str | None = None,
                   step: str | None = None) -> Switches:
        """These switches with one call's overrides (None keeps a switch); a kv_cache given
        without kv_kernel is read by its default kernel. Checked like any Switches."""
        kernel = kv_kernel if kv_kernel is not None or kv_cache is not None else self.kv_kernel
        return Switches(attention or self.attention, kv_cache or self.kv_cache, kernel, step or self.step)


def switch_property(name: str, doc: str, **resets) -> property:
    """A model's switch as a property over its `switches` (a model class that holds them and
    applies a change in `_set_switches(new)`); setting it also sets `resets` (a new kv_cache
    resets kv_kernel to the format's default)."""
    def get(self):
        return getattr(self.switches, name)

    def set_(self, value) -> None:
        self._set_switches(replace(self.switches, **{name: value, **resets}))

    return property(get, set_, doc=doc)


class SwitchProperties:
    """attention / kv_cache / kv_kernel / step of a model that holds `switches` (Model, and
    DistributedModel on the ranks); validated, never touching the weights."""

    attention = switch_property("attention", "The attention backend (ATTENTION_BACKENDS).")
    kv_cache = switch_property("kv_cache", "The KV-cache format (KV_FORMATS); a new one is read by its default "
                               "kernel (set kv_kernel after it for another).", kv_kernel=None)
    kv_kernel = switch_property("kv_kernel", "The kernel that reads the cache (KV_KERNELS), or None for the "
                                "format's default.")
    step = switch_property("step", '"fused" (one C++ call per decode step, where the switches allow) or '
                           '"reference".')
