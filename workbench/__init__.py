"""CPU LLM inference workbench: the paper's kernels and runtime as a Python library.

    import workbench as wb
    model = wb.load_model("smollm2-135m")
    out = model.generate("The capital of France is", attention="slim", kv_cache="int8")

Layers, bottom up (each imports only from those before it):

    workbench.hw         the machine: CPU, caches, measured bandwidth and FMA peaks
    workbench.kernels    the C++ kernels (sources in the repository's kernels/), built on first use
    workbench.model      configs, weight dtypes, KV formats, attention backends, the Llama model, loaders
    workbench.runtime    a loaded Model: generate, sampling, timing records, streaming, threads
    workbench.analysis   experiments: teacher forcing, ablation grids, the demo, kernel comparisons
    workbench.ui         the live plotly figures and the ipywidgets control panel
    workbench.distributed  tensor parallel: collectives, sharding, ipyparallel engines
    workbench.report     shareable reports: JSON (workbench/report/schema.json) and offline HTML
    workbench.magics     the IPython magics (the repository's magics/), `%load_ext workbench`
    workbench.cli        the `workbench` command
"""

__version__ = "0.1.0"

from workbench.model.loaders import ModelLoadError  # noqa: E402
from workbench.runtime.generate import GenerationResult, Model, load_model  # noqa: E402
from workbench.runtime.status import status_report  # noqa: E402
from workbench import report  # noqa: E402  (wb.report.record / wb.report.write)

__all__ = ["GenerationResult", "Model", "ModelLoadError", "cluster", "kv_quality", "load_model", "panel", "predict",
           "report", "status_report"]


def kv_quality(model, formats=None, context=1024, steps: int = 64, text: str | None = None, **kwargs):
    """Each KV-cache format's effect on the model's predictions over real text (perplexity,
    KL to an fp32 cache, top-1 agreement, bytes per element): a pandas DataFrame, one row per
    (context, format). See workbench.analysis.quality.kv_quality."""
    import pandas as pd

    from workbench.analysis.quality import kv_quality as run
    from workbench.model.kv_formats import KV_FORMATS

    return pd.DataFrame(run(model, tuple(formats or KV_FORMATS), context=context, steps=steps, text=text, **kwargs))


def predict(model="smollm2-135m", **kwargs):
    """The roofline cost model of a prefill and a decode step, per layer and part (see
    workbench.analysis.costmodel.predict): batch, prompt_len, new_tokens, kv_cache,
    weight_dtype, ranks, backend, hardware. `.compare(result.timings)` sets it against a run."""
    from workbench.analysis.costmodel import predict as run

    return run(model, **kwargs)


def cluster(n: int = 2, **kwargs):
    """Start a tensor-parallel cluster of n ranks on ipyparallel engines (see
    workbench.distributed.cluster.Cluster): backend="shm" | "gloo", threads_per_rank, pin,
    launcher, timeout_s. Then cluster.load_model(name) gives a DistributedModel."""
    from workbench.distributed.cluster import cluster as start

    return start(n, **kwargs)


def panel(model=None):
    """The ipywidgets control panel with live plots (see workbench.ui.panel)."""
    from workbench.ui.panel import panel as make

    return make(model)


def load_ipython_extension(ipython) -> None:
    """`%load_ext workbench`: register the magics (workbench.magics, the IPython layer)."""
    from workbench.magics import load_ipython_extension as load

    load(ipython)
