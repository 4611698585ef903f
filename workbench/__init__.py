"""CPU LLM inference workbench: the paper's kernels and runtime as a Python library.

    import workbench as wb
    model = wb.load_model("smollm2-135m")
    out = model.generate("The capital of France is", attention="slim", kv_cache="int8")

Layers, bottom up: each imports only from those before it (tests/test_layers.py checks it,
and README's Layout states the same order):

    workbench.cache        the cache folder and the CPU key builds and measurements are filed under
    workbench.hw           the machine: CPU, ISA flags, caches, huge-page memory
    workbench.kernels      the C++ kernels (sources in the repository's kernels/), built on first
                           use, tuned per host (prefetch), and the peaks they measure (triad, FMA)
    workbench.model        configs, weight formats, KV formats, attention backends, the Llama model,
                           its step records (timing), loaders
    workbench.runtime      a loaded Model: generate, sampling, streaming, threads
    workbench.distributed  tensor parallel: collectives and their measured cost, sharding, engines
    workbench.analysis     experiments: teacher forcing, ablations, the demo, quality, cost model, peers
    workbench.ui           the live plotly figures and the ipywidgets control panel
    workbench.report       shareable reports: JSON (workbench/report/schema.json) and offline HTML
    workbench.options, workbench.magics   options shared by the CLI and the magics; `%load_ext workbench`
    workbench.cli          the `workbench` command
"""

__version__ = "0.1.0"

import importlib

# What `wb.<name>` gives, imported on first use: `import workbench.hw` loads only the machine
# layer, not the model, the kernels or the report layer.
_LAZY = {"ModelLoadError": "workbench.model.loaders", "GenerationResult": "workbench.runtime.model",
         "Model": "workbench.runtime.model", "load_model": "workbench.runtime.model",
         "status_report": "workbench.runtime.status", "report": "workbench.report",
         "Scheduler": "workbench.serving.scheduler", "serve_bench": "workbench.analysis.serve_bench"}

__all__ = ["GenerationResult", "Model", "ModelLoadError", "Scheduler", "cluster", "kv_quality", "load_model",
           "expert_routing", "measure_allreduce", "panel", "predict", "report", "serve_bench", "status_report"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'workbench' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name])
    value = module if _LAZY[name] == f"workbench.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


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


def expert_routing(model, text: str | None = None, tokens: int = 2048):
    """Where a loaded mixture of experts routes `tokens` tokens of real text, layer by layer:
    tokens per expert, entropy, the busiest expert's share, and the distinct experts a batch
    touches (see workbench.analysis.experts). wb.predict(model, routing=...) takes it."""
    from workbench.analysis.experts import expert_routing as run

    return run(model, text, tokens)


def measure_allreduce(backend: str, ranks: int = 2, cluster=None):
    """Measure this machine's all-reduce alpha-beta fit for `backend` on `ranks` processes (on
    `cluster` if given, else on engines started and stopped here, about 10 s) and cache it for
    wb.predict and the reports (see workbench.distributed.allreduce)."""
    from workbench.distributed.allreduce import measure_allreduce as run

    return run(backend, ranks, cluster=cluster)


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
