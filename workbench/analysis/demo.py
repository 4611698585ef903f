"""The workbench's main job: every attention backend x every KV-cache format (int8 with each
kernel that reads it) on one model,
for a short and a long prompt of real English text (an ablation grid, see
workbench.analysis.ablation): prefill ms, decode tokens/s, achieved GB/s and GFLOP/s with their
shares of the measured bandwidth and FMA peaks, and top-1 agreement with the naive /
fp32-cache reference.
"""

from __future__ import annotations

from workbench.analysis.ablation import AblationRow, format_table, run_ablation
from workbench.model.attention import ATTENTION_BACKENDS
from workbench.model.kv_formats import KERNEL_FORMATS


def run_demo(model, short_tokens: int = 16, long_tokens: int = 512, new_tokens: int = 32,
             progress=None, repeats: int = 3) -> list[AblationRow]:
    return run_ablation(model, tuple(ATTENTION_BACKENDS), KERNEL_FORMATS, prompt_lens=(short_tokens, long_tokens),
                        batches=(1,), new_tokens=new_tokens, progress=progress, repeats=repeats, kv_kernels="all")


__all__ = ["format_table", "run_demo"]
