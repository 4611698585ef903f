"""The control panel: an ipywidgets front end over load_model / generate and the figures.

    import workbench as wb
    wb.panel()              # follows the notebook's model (%load_model), loaded before or after
    wb.panel(model)         # bound to this model

Model picker and Load (the "layers" box only for random presets); attention and KV-cache
toggles that are the model's own switches (so `%kvcache int8` moves the toggle, and the
toggle moves `model.kv_cache`); batch, prompt length and new tokens; a prompt box (empty:
an excerpt of a license text); repeats and warm-up; whether to draw while running; Run,
a progress bar, the sequences' text, the summary (median and min-max over the repeats);
export of the runs as JSON or CSV; the three figures of workbench.ui.plots, earlier runs
kept as faint traces. Serving: "Serve-bench" starts `workbench serve` on the panel's model
(a process of its own), loads it at each of the rates given (or all requests at once under
the concurrency), stops it, and shows TTFT / TPOT percentiles and tokens/s per load with the
latency-throughput figure (the knee) of workbench.ui.plots.

Every measured run is recorded for `%report` (workbench.report.record) with a Python
command that reproduces it. The panel's output carries a static copy of its figures (plain
SVG, workbench.ui.static) as the HTML fallback of its widget view, refreshed when a run
ends: a notebook saved after a run shows the figures wherever widgets cannot be drawn.

Numbers: the warm-up run (same settings, untimed) takes first-call costs out of the
measured runs; the figures show the run whose decode tokens/s is the median. Drawing
during a run costs the machine CPU time: the browser repaints the figures while the model
runs, which on a 2-core machine took 60-80% of a core and cut tokens/s by up to 4x; so on
machines with few cores the panel draws only when a run ends, unless "draw live" is on.
"""

from __future__ import annotations

import csv
import html
import json
import os
import statistics
import time
from pathlib import Path

import ipywidgets as W

from workbench.model.attention import ATTENTION_BACKENDS
from workbench.model.config import PRESETS
from workbench.model.kv_formats import KV_FORMATS, kv_label, parse_kv
from workbench.model.loaders import BUNDLED_MODEL, BUNDLED_MODELS
from workbench.ui.plots import LivePlots

RANDOM = " --random"
FEW_CORES = 4  # at or below this many CPUs, figures are drawn only at the end of a run
RUN_FIELDS = ("attention", "kv_cache", "kv_kernel", "batch", "prompt_len", "new_tokens", "repeat", "prefill_ms",
              "time_to_first_token_ms", "decode_tokens_per_s", "decode_tokens_per_s_per_sequence", "decode_gbps",
              "decode_gflops")


def _kv_value(fmt: str, kernel: str | None) -> str:
    """A cache as the KV dropdown's value: "int8:tile" where the format has several kernels."""
    kernels = KV_FORMATS[fmt].kernels
    return f"{fmt}:{kernel or kernels[0]}" if len(kernels) > 1 else fmt


def _kv_options() -> list[tuple[str, str]]:
    """(label, value) for every format and each of its kernels, the default kernel first."""
    return [(kv_label(name, kernel), _kv_value(name, kernel)) for name, fmt in KV_FORMATS.items()
            for kernel in (fmt.kernels if len(fmt.kernels) > 1 else [None])]


def _html_output(html_text: str, plain: str) -> dict:
    """HTML as one output of an ipywidgets Output (nbformat's display_data), text elsewhere.

    The panel's Outputs are changed only through their `outputs` state, set here in the
    kernel: appended to, or emptied with `outputs = ()`. Output.clear_output() instead sends a
    clear message that the browser applies and then writes back as an empty state; that echo
    crossed the text a run had just appended, and emptied the text box after every other run."""
    return {"output_type": "display_data", "metadata": {}, "data": {"text/html": html_text, "text/plain": plain}}


def _slider(cls, **kw):
    # A minimum width keeps the sliders usable in a narrow (split) JupyterLab view.
    return cls(layout=W.Layout(min_width="260px", flex="1 1 260px"), style={"description_width": "initial"}, **kw)


class Panel:
    def __init__(self, model=None, peak_gbps: float | None = None):
        from workbench.runtime import session

        self.session = session.current
        self.follows_session = model is None
        self.model = None
        self.result = None
        self.runs: list[dict] = []  # every measured run, for export
        names = [*BUNDLED_MODELS] + [f"{p}{RANDOM}" for p in PRESETS if p != BUNDLED_MODEL]
        self.model_picker = W.Dropdown(options=names, value=BUNDLED_MODEL, description="model")
        self.layers = W.BoundedIntText(value=2, min=1, max=80, description="layers", layout=W.Layout(width="160px"),
                                       tooltip="random presets: keep this many layers")
        self.load_button = W.Button(description="Load", icon="download")
        # Tensor parallel: 1 rank is this process; more start ipyparallel engines on Load.
        from workbench.distributed.backends import BACKENDS

        cpus = len(os.sched_getaffinity(0))
        self.ranks = W.Dropdown(options=list(range(1, cpus + 1)), value=1, description="ranks",
                                layout=W.Layout(width="140px"))
        self.backend = W.ToggleButtons(options=list(BACKENDS), value="shm", description="backend",
                                       tooltip="collectives between the ranks (used when ranks > 1)")
        self.check_topk = W.Checkbox(value=False, description="check top-k (ranks > 1)", indent=False)
        self.cluster = None  # the cluster this panel started
        self.attention = W.ToggleButtons(options=list(ATTENTION_BACKENDS), value="slim", description="attention")
        # a dropdown of every format and kernel ("int8 (dot)": int8 read by the dot kernel); the
        # quality study's reference-path formats make the list long
        self.kv_cache = W.Dropdown(options=_kv_options(), value="fp32", description="KV cache")
        self.batch = _slider(W.IntSlider, value=1, min=1, max=16, description="batch")
        self.prompt_len = _slider(W.IntSlider, value=64, min=8, max=1024, step=8, description="prompt tokens")
        self.new_tokens = _slider(W.IntSlider, value=32, min=2, max=256, description="new tokens")
        self.prompt = W.Textarea(value="", placeholder="prompt (empty: an excerpt of the Apache license, cut to "
                                 "'prompt tokens')", layout=W.Layout(width="100%", height="60px"))
        # three measured runs by default: every number the panel shows has a spread beside it
        self.repeats = W.BoundedIntText(value=3, min=1, max=20, description="repeats", layout=W.Layout(width="160px"))
        self.warmup = W.Checkbox(value=True, description="warm-up run first", indent=False)
        few = (os.cpu_count() or 1) <= FEW_CORES
        self.live = W.Checkbox(value=not few, description="draw live", indent=False,
                               tooltip="redraw the figures during the run (costs CPU time in the browser)")
        self.run_button = W.Button(description="Run", icon="play", button_style="primary")
        self.progress = W.IntProgress(value=0, min=0, max=1, description="idle")
        self.export_json = W.Button(description="Export JSON", icon="save")
        self.export_csv = W.Button(description="Export CSV", icon="save")
        self.status = W.HTML()
        self.note = W.HTML(value=(f"<small>{os.cpu_count()} CPUs: the figures are drawn when a run ends, so the "
                                  f"browser does not compete with the run for the CPU (tick 'draw live' to "
                                  f"watch it anyway).</small>" if few else ""))
        self.summary = W.HTML()
        # Serving under load: a server on this model, loaded by serve-bench (rates: req/s, or max)
        self.serve_rates = W.Text(value="max", description="rates", layout=W.Layout(width="220px"),
                                  tooltip="requests/s, comma-separated for a sweep; max: all at once under concurrency")
        self.serve_concurrency = W.BoundedIntText(value=8, min=1, max=256, description="concurrency",
                                                  layout=W.Layout(width="180px"))
        self.serve_requests = W.BoundedIntText(value=16, min=1, max=10000, description="requests",
                                               layout=W.Layout(width="180px"))
        self.serve_button = W.Button(description="Serve-bench", icon="server")
        self.serve_output = W.Output(layout=W.Layout(width="100%"))
        self.serve_button.on_click(self.serve_bench)
        self.output = W.Output(layout=W.Layout(border="1px solid #ddd", min_height="40px", width="100%"))
        self.plots = LivePlots(widget=True, peak_gbps=peak_gbps, live=self.live.value)
        self.load_button.on_click(self.load)
        self.run_button.on_click(self.run)
        self.export_json.on_click(lambda _: self._export_clicked("json"))
        self.export_csv.on_click(lambda _: self._export_clicked("csv"))
        self.model_picker.observe(self._show_layers, "value")
        self.attention.observe(lambda c: self._toggle("attention", c["new"]), "value")
        self.kv_cache.observe(lambda c: self._set_kv(c["new"]), "value")
        self.live.observe(lambda c: setattr(self.plots, "live", c["new"]), "value")
        self.ranks.observe(self._show_rank_options, "value")
        self._displays = []  # handles of this panel's outputs, refreshed with the static figures
        self.widget = W.VBox([
            W.HBox([self.model_picker, self.layers, self.ranks, self.load_button],
                   layout=W.Layout(flex_flow="row wrap")),
            W.HBox([self.backend, self.check_topk], layout=W.Layout(flex_flow="row wrap")), self.status,
            self.attention, self.kv_cache,
            W.HBox([self.batch, self.prompt_len, self.new_tokens], layout=W.Layout(flex_flow="row wrap")),
            self.prompt,
            W.HBox([self.repeats, self.warmup, self.live], layout=W.Layout(flex_flow="row wrap")),
            W.HBox([self.run_button, self.progress, self.export_json, self.export_csv],
                   layout=W.Layout(flex_flow="row wrap")),
            self.note, self.summary, self.output, self.plots.box(),
            W.HTML("<b>Serving</b> <small>(a <code>workbench serve</code> process on this model; prompt "
                   "tokens and new tokens as above)</small>"),
            W.HBox([self.serve_rates, self.serve_concurrency, self.serve_requests, self.serve_button],
                   layout=W.Layout(flex_flow="row wrap")),
            self.serve_output,
        ], layout=W.Layout(width="100%"))
        self._show_layers()
        self._show_rank_options()
        if self.follows_session:
            self.session.on_model(self._bind)
            model = self.session.model
        self._bind(model)

    # -- state: the model and its switches ------------------------------------------------

    def _bind(self, model) -> None:
        """Follow `model`: its description, and its switches in both directions."""
        self.model = model
        if model is not None:
            model.on_switch(lambda sw, m=model: self._show_switches(m))
            self._show_switches(model)
            self.plots.set_layers(model.config.n_layers)  # empty figures' axes span the model's layers
        self.status.value = self._status_html()

    def _show_switches(self, model) -> None:
        if model is self.model:
            self.attention.value, self.kv_cache.value = model.attention, _kv_value(model.kv_cache, model.kv_kernel)

    def _toggle(self, name: str, value: str) -> None:
        if self.model is not None and getattr(self.model, name) != value:
            setattr(self.model, name, value)

    def _set_kv(self, value: str) -> None:
        """The dropdown's "format:kernel" as the model's kv_cache and kv_kernel."""
        if self.model is None or _kv_value(self.model.kv_cache, self.model.kv_kernel) == value:
            return
        fmt, kernel = parse_kv(value)
        self.model.kv_cache = fmt  # resets the kernel to the format's default
        if kernel is not None:
            self.model.kv_kernel = kernel

    def _show_rank_options(self, _=None) -> None:
        """The collectives' backend and the top-k check mean something only with several ranks."""
        shown = None if self.ranks.value > 1 else "none"
        self.backend.layout.display = self.check_topk.layout.display = shown

    def _show_layers(self, _=None) -> None:
        self.layers.layout.display = None if self.model_picker.value.endswith(RANDOM) else "none"

    def _status_html(self) -> str:
        if self.model is None:
            return "<i>no model loaded: pick one and press Load (or run %load_model)</i>"
        c = self.model.config
        return (f"<b>{html.escape(self.model.description)}</b>: {c.n_layers} layers, dim {c.dim}, "
                f"{c.n_heads} heads ({c.n_kv_heads} KV), weights {self.model.weight_dtype}")

    def _error(self, message: str) -> None:
        self.output.append_stdout(f"error: {message}\n")

    # -- actions ----------------------------------------------------------------------------

    def load(self, _=None) -> None:
        import workbench as wb

        from workbench.distributed.cluster import Cluster, DistributedError, running

        name = self.model_picker.value
        random = name.endswith(RANDOM)
        kwargs = dict(random=random, layers=self.layers.value if random else None)
        self.output.outputs = ()  # not clear_output(): see _html_output
        try:
            if self.ranks.value > 1:
                if running() is not None and running() is not self.cluster:
                    raise ValueError("a cluster started elsewhere is running: %distributed stop first")
                if self.cluster is not None:
                    self.cluster.stop()
                self.status.value = f"<i>starting {self.ranks.value} engines ({self.backend.value})...</i>"
                self.cluster = Cluster(self.ranks.value, backend=self.backend.value, pin=True).start()
                model = self.cluster.load_model(name.removesuffix(RANDOM), **kwargs)
            else:
                model = wb.load_model(name.removesuffix(RANDOM), **kwargs)
                if self.cluster is not None:
                    self.cluster.stop()
                    self.cluster = None
        except (wb.ModelLoadError, ValueError, DistributedError) as e:
            self._error(str(e))
            self.status.value = self._status_html()
            return
        fmt, kernel = parse_kv(self.kv_cache.value)
        model.attention, model.kv_cache = self.attention.value, fmt
        if kernel is not None:
            model.kv_kernel = kernel
        if self.follows_session:
            self.session.model = model  # the magics see it too; _bind follows
        else:
            self._bind(model)

    def prompts(self) -> list:
        """The batch's prompts: the prompt box's text for every sequence, or license-text
        excerpts of exactly `prompt tokens` tokens."""
        from workbench.analysis.text import sample_prompts

        text = self.prompt.value.strip()
        if text:
            return [text] * self.batch.value
        return sample_prompts(self.model.tokenizer, self.prompt_len.value, self.batch.value)

    def run(self, _=None) -> None:
        """Warm up (if ticked), then `repeats` measured runs with the current settings."""
        self.output.outputs = ()  # not clear_output(): see _html_output
        if self.model is None:
            self._error("no model loaded: pick one and press Load, or run %load_model first")
            return
        prompts, n = self.prompts(), self.new_tokens.value
        settings = dict(max_new_tokens=n, stop_at_eos=False)  # attention and KV: the model's switches (the toggles)
        repeats = self.repeats.value
        self.progress.max, self.progress.value = repeats * n, 0
        self.run_button.disabled = True
        self.plots.predicted = None  # until this run's settings are predicted (at its end)
        results = []
        try:
            if self.warmup.value:
                self.progress.description = "warm-up"
                self.model.generate(prompts, **{**settings, "max_new_tokens": min(n, 8)}, record=False)
            for r in range(repeats):
                self.progress.description = f"run {r + 1}/{repeats}"

                def on_token(step, ids, done=r * n):
                    self.progress.value = done + step + 1

                extra = {"check_topk": self.check_topk.value} if hasattr(self.model, "cluster") else {}
                results.append(self.model.generate(prompts, **settings, on_token=on_token,
                                                   on_step=self.plots.on_step, **extra))
        except (ValueError, RuntimeError) as e:
            self._error(str(e))
            return
        finally:
            self.run_button.disabled = False
            self.progress.description = "done"
        self._finish(results)

    def _finish(self, results) -> None:
        batch = self.batch.value
        rows = []
        for i, res in enumerate(results):
            s = res.timings.summary()
            rows.append({"attention": res.switches.attention, "kv_cache": res.switches.kv_cache,
                         "kv_kernel": res.switches.kv_kernel, "kv": res.switches.kv_text, "batch": batch,
                         "prompt_len": len(res.prompt_token_ids[0]), "new_tokens": self.new_tokens.value,
                         "repeat": i + 1, **s, "decode_tokens_per_s_per_sequence": s["decode_tokens_per_s"] / batch,
                         "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
        self.runs.extend(rows)
        order = sorted(range(len(results)), key=lambda i: rows[i]["decode_tokens_per_s"])
        median = order[len(order) // 2]
        self.result = results[median]
        label = f"{self.result.switches.attention} / {self.result.switches.kv_text}, batch {batch}"
        self.plots.predicted = self._prediction(self.result)
        self.plots.finish(self.result.timings, label, batch, getattr(self.result, "topk_log", None))
        self.summary.value = self._summary_html(rows) + self._against_previous(rows)
        self._previous_rows = rows
        self._record(results)
        self._refresh_displays()
        texts = self.result.text if isinstance(self.result.text, list) else [self.result.text]
        self.output.outputs += (_html_output(
            "".join(f"<div><b>sequence {b}</b> continues:<pre style='white-space: pre-wrap; margin: 2px 0'>"
                    f"{html.escape(t)}</pre></div>" for b, t in enumerate(texts)),
            "\n".join(f"sequence {b} continues: {t}" for b, t in enumerate(texts))),)

    def _record(self, results) -> None:
        """Every measured run into this session's report (through the session: the report layer
        takes them when it records), with the command that reproduces it."""
        command = self.reproduce_command()
        prompt = self.prompt.value.strip() or None
        for res in results:
            self.session.add_measurement(res, self.model, command, prompt)

    def reproduce_command(self) -> str:
        """Python that loads the same model, sets the same switches and panel settings and runs
        it again (in IPython or a notebook cell)."""
        from workbench.runtime.threads import get_threads

        m = self.model
        args = dict(m.load_args)
        name = args.pop("name_or_path", None) or m.config.name
        defaults = {"random": False, "layers": None, "dtype": "fp32", "seed": 0, "max_batch": 1, "max_seq_len": None}
        extra = "".join(f", {k}={v!r}" for k, v in args.items() if defaults.get(k, object()) != v)
        cluster = getattr(m, "cluster", None)
        lines = ["import workbench as wb", "from workbench.runtime.threads import set_threads",
                 f"set_threads({get_threads()})"]
        if cluster is not None:
            lines += [f"cluster = wb.cluster({cluster.n}, backend={cluster.backend!r}, "
                      f"threads_per_rank={cluster.threads_per_rank}, pin={cluster.pin})",
                      f"model = cluster.load_model({name!r}{extra})",
                      "model.set_options(" + ", ".join(f"{k}={v!r}" for k, v in vars(m.options).items()) + ")"]
        else:
            lines.append(f"model = wb.load_model({name!r}{extra})")
        lines.append(f"model.attention, model.kv_cache = {m.attention!r}, {m.kv_cache!r}")
        if m.kv_kernel is not None:
            lines.append(f"model.kv_kernel = {m.kv_kernel!r}")
        lines += ["p = wb.panel(model)",
                  f"p.batch.value, p.prompt_len.value, p.new_tokens.value = {self.batch.value}, "
                  f"{self.prompt_len.value}, {self.new_tokens.value}",
                  f"p.prompt.value = {self.prompt.value!r}",
                  f"p.repeats.value, p.warmup.value, p.check_topk.value = {self.repeats.value}, {self.warmup.value}, "
                  f"{self.check_topk.value}",
                  "p.run()"]
        if cluster is not None:
            lines.append("cluster.stop()")
        return "\n".join(lines)

    def serve_bench(self, _=None) -> list[dict] | None:
        """Start `workbench serve` on this model, load it at each rate, stop it; show the rows
        and the knee, record them for %report. Returns the rows (None on an error)."""
        from workbench.analysis.serve_bench import format_rows, serve_bench
        from workbench.serving.process import ServerProcess, server_args
        from workbench.ui.plots import figure_output, knee_spec

        self.serve_output.outputs = ()
        if self.model is None:
            return self._serve_error("no model loaded: pick one and press Load, or run %load_model first")
        if getattr(self.model, "cluster", None) is not None:
            return self._serve_error("serve-bench runs one server process: load the model on 1 rank")
        try:
            rates = [None if r.strip() == "max" else float(r) for r in self.serve_rates.value.split(",")]
        except ValueError:
            return self._serve_error(f"rates must be numbers (requests/s) or max, comma-separated; got "
                                     f"{self.serve_rates.value!r}")
        options = server_args(self.model, slots=self.serve_concurrency.value,
                              max_len=self.prompt_len.value + self.new_tokens.value + 64)
        server = ServerProcess(options)
        self.serve_button.disabled = True
        self.progress.description = "serving"
        try:
            server.start()
            rows = serve_bench(server.url, rates=rates, concurrency=self.serve_concurrency.value,
                               num_requests=self.serve_requests.value, prompt_tokens=self.prompt_len.value,
                               max_tokens=self.new_tokens.value, label="workbench serve")
        except (ValueError, RuntimeError) as e:
            return self._serve_error(str(e))
        finally:
            server.stop()
            self.serve_button.disabled = False
            self.progress.description = "done"
        bench = ["workbench", "serve-bench", "--url", server.url, "--rate", self.serve_rates.value.replace(" ", ""),
                 "--concurrency", str(self.serve_concurrency.value), "--num-requests", str(self.serve_requests.value),
                 "--prompt-tokens", str(self.prompt_len.value), "--max-tokens", str(self.new_tokens.value)]
        command = "\n".join([f"{server.shell_command} &", " ".join(bench), "kill %1"])
        self.session.add_rows(rows, "serve_bench", command)
        self._serve_show(f"<pre>{html.escape(format_rows(rows))}</pre>", format_rows(rows))
        if len(rows) > 1:  # a sweep: the latency-throughput curve
            self.serve_output.outputs += (figure_output(knee_spec(rows)),)
        return rows

    def _serve_error(self, message: str) -> None:
        self._serve_show(f"<b style='color:#b00'>{html.escape(message)}</b>", message)

    def _serve_show(self, html_text: str, plain: str) -> None:
        """HTML in the serving output, kept as such in a saved notebook."""
        self.serve_output.outputs += (_html_output(html_text, plain),)

    def _mimebundle(self) -> dict:
        """The widget view, with the static figures of the last run as its HTML fallback."""
        from workbench.ui.static import figures_html

        bundle = dict(self.widget._repr_mimebundle_())
        if self.result is not None:
            label = f"{self.result.switches.attention} / {self.result.switches.kv_text}, batch {self.batch.value}"
            bundle["text/html"] = figures_html(self.result.timings, label, self.batch.value, self.plots.peak_gbps)
        else:
            bundle["text/html"] = "<p><i>workbench panel: no run yet (its figures are drawn after a run)</i></p>"
        return bundle

    def _refresh_displays(self) -> None:
        for handle in self._displays:
            handle.update(self._mimebundle(), raw=True)

    def _prediction(self, result) -> dict | None:
        """The cost model's per-layer rows for the run's settings (the dashed line of the
        latency figure); a failure to predict is said below the figures, not raised."""
        from workbench.analysis.costmodel import predict_run

        try:
            p = predict_run(self.model, result)
        except (ValueError, RuntimeError) as e:
            self.output.append_stdout(f"no roofline prediction drawn: {e}\n")
            return None
        return p.per_layer_ms()

    def _against_previous(self, rows: list[dict]) -> str:
        """This run against the one before it (other settings, drawn faint): a ratio of decode
        tokens/s, or a warning when their min-max ranges overlap (the difference is within the
        run-to-run spread), or when either run had one repeat (no spread to judge by)."""
        before = getattr(self, "_previous_rows", None)
        if not before:
            return ""
        now, then = ([r["decode_tokens_per_s"] for r in rs] for rs in (rows, before))
        name = f"{before[0]['attention']} / {before[0]['kv']}, batch {before[0]['batch']}"
        ratio = statistics.median(now) / statistics.median(then)
        if len(now) == 1 or len(then) == 1:
            return (f"<br><b>warning:</b> {ratio:.2f}x the decode tokens/s of the previous run ({html.escape(name)}) "
                    f"with one run on a side: no spread to tell it from noise (set repeats to 3 or more)")
        if min(now) <= max(then) and min(then) <= max(now):
            return (f"<br><b>warning:</b> decode tokens/s within the run-to-run spread of the previous run "
                    f"({html.escape(name)}: {min(then):.1f}-{max(then):.1f}); the {ratio:.2f}x between medians is "
                    f"not a difference")
        return f"<br>{ratio:.2f}x the decode tokens/s of the previous run ({html.escape(name)}), beyond the spread of both"

    @staticmethod
    def _summary_html(rows: list[dict]) -> str:
        def spread(key: str, digits: int) -> str:
            values = [r[key] for r in rows]
            med = statistics.median(values)
            if len(values) == 1:
                return f"{med:.{digits}f}"
            return f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

        r0 = rows[0]
        what = "median (min-max) of " + (f"{len(rows)} runs" if len(rows) > 1 else "1 run")
        batch = r0["batch"]
        rate = (f"{spread('decode_tokens_per_s', 1)} tokens/s for all {batch} sequences together = "
                f"{spread('decode_tokens_per_s_per_sequence', 1)} per sequence" if batch > 1 else
                f"{spread('decode_tokens_per_s', 1)} tokens/s (one sequence)")
        return (f"<b>{r0['attention']} / {r0['kv']} KV, batch {batch}, {r0['prompt_len']} prompt tokens,"
                f" {r0['new_tokens']} new</b> ({what}): prefill {spread('prefill_ms', 1)} ms | decode {rate} | "
                f"{spread('decode_gbps', 2)} GB/s, {spread('decode_gflops', 1)} GFLOP/s")

    def export(self, path) -> Path:
        """Write every measured run to `path`: .json (the runs, and the shown run's per-layer
        ms for prefill and decode) or .csv (one row per run)."""
        path = Path(path)
        if path.suffix not in (".json", ".csv"):
            raise ValueError(f"export path must end in .json or .csv, got {str(path)!r}")
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".json":
            shown = self.result.timings if self.result else None
            path.write_text(json.dumps({
                "model": self.model.description if self.model else None, "runs": self.runs,
                "per_layer_ms": {p: shown.per_layer(p) for p in ("prefill", "decode")} if shown else {},
            }, indent=2))
        else:
            with path.open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=[*RUN_FIELDS, "time"], extrasaction="ignore")
                writer.writeheader()
                writer.writerows(self.runs)
        return path

    def _export_clicked(self, kind: str) -> None:
        if not self.runs:
            self._error("nothing to export yet: press Run first")
            return
        from workbench.cache import results_dir

        path = self.export(results_dir() / f"panel-{time.strftime('%Y%m%d-%H%M%S')}.{kind}")
        self.output.append_stdout(f"wrote {path.resolve()}\n")

    def _ipython_display_(self):
        from IPython.display import display

        handle = display(self._mimebundle(), raw=True, display_id=True)
        if handle is not None:
            self._displays.append(handle)


def panel(model=None) -> Panel:
    """The control panel (display it, or let it be the cell's value)."""
    return Panel(model)
