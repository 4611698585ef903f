"""CPU LLM inference workbench: the paper's kernels and runtime as a Python library.

Sub-packages: `workbench.kernels` (C++ attention / KV-cache kernels), `workbench.machine`
(hardware facts), `workbench.peaks` (measured bandwidth and FMA peaks).
"""

__version__ = "0.1.0"

from workbench.loaders import ModelLoadError  # noqa: E402
from workbench.runtime import GenerationResult, Model, load_model  # noqa: E402

__all__ = ["GenerationResult", "Model", "ModelLoadError", "load_model", "panel"]


def panel(model=None):
    """The ipywidgets control panel with live plots (see workbench.control_panel)."""
    from workbench.control_panel import panel as make

    return make(model)


def load_ipython_extension(ipython) -> None:
    """`%load_ext workbench`: register the magics (magics/ holds the IPython layer)."""
    from magics import load_ipython_extension as load

    load(ipython)
