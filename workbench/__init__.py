"""CPU LLM inference workbench: the paper's kernels and runtime as a Python library.

Sub-packages: `workbench.kernels` (C++ attention / KV-cache kernels), `workbench.machine`
(hardware facts), `workbench.peaks` (measured bandwidth and FMA peaks).
"""

__version__ = "0.1.0"
