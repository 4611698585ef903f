"""The control panel: an ipywidgets front end over load_model / generate and the live plots.

    import workbench as wb
    wb.panel()            # in JupyterLab or Jupyter Notebook

Model picker and Load button; attention and KV-cache toggles; batch, prompt-length and
new-token sliders; a Run button, a progress bar, an output area for text and errors, and
the three live figures of workbench.ui.plots, refreshed while a run is in progress. Every
action calls the library; a failure is shown in the output area and leaves the loaded
model as it was.
"""

from __future__ import annotations

import ipywidgets as W

from workbench.model.attention import ATTENTION_BACKENDS
from workbench.model.config import PRESETS
from workbench.model.kv_formats import KV_FORMATS
from workbench.model.loaders import BUNDLED_MODEL
from workbench.ui.plots import LivePlots


class Panel:
    def __init__(self, model=None, peak_gbps: float | None = None):
        self.model = model
        self.result = None
        names = [BUNDLED_MODEL] + [f"{p} --random" for p in PRESETS if p != BUNDLED_MODEL]
        self.model_picker = W.Dropdown(options=names, value=BUNDLED_MODEL, description="model")
        self.layers = W.BoundedIntText(value=2, min=1, max=80, description="layers", layout=W.Layout(width="160px"),
                                       tooltip="for --random presets: how many layers to keep")
        self.load_button = W.Button(description="Load", icon="download")
        self.attention = W.ToggleButtons(options=list(ATTENTION_BACKENDS), value="slim", description="attention")
        self.kv_cache = W.ToggleButtons(options=list(KV_FORMATS), value="fp32", description="KV cache")
        self.batch = W.IntSlider(value=1, min=1, max=16, description="batch")
        self.prompt_len = W.IntSlider(value=64, min=8, max=1024, step=8, description="prompt len")
        self.new_tokens = W.IntSlider(value=32, min=2, max=256, description="new tokens")
        self.run_button = W.Button(description="Run", icon="play", button_style="primary")
        self.progress = W.IntProgress(value=0, min=0, max=1, description="idle")
        self.status = W.HTML(value=self._status_html())
        self.output = W.Output(layout=W.Layout(border="1px solid #ddd", min_height="40px"))
        self.plots = LivePlots(widget=True, peak_gbps=peak_gbps)
        self.load_button.on_click(self.load)
        self.run_button.on_click(self.run)
        self.widget = W.VBox([
            W.HBox([self.model_picker, self.layers, self.load_button]), self.status,
            self.attention, self.kv_cache,
            W.HBox([self.batch, self.prompt_len, self.new_tokens]),
            W.HBox([self.run_button, self.progress]), self.output, self.plots.box(),
        ])

    def _status_html(self) -> str:
        if self.model is None:
            return "<i>no model loaded: pick one and press Load</i>"
        c = self.model.config
        return (f"<b>{self.model.description}</b>: {c.n_layers} layers, dim {c.dim}, "
                f"{c.n_heads} heads ({c.n_kv_heads} KV), weights {self.model.llama.weight_dtype}")

    def load(self, _=None) -> None:
        import workbench as wb

        name = self.model_picker.value
        random = name.endswith(" --random")
        self.output.clear_output()
        try:
            model = wb.load_model(name.removesuffix(" --random"), random=random,
                                  layers=self.layers.value if random else None)
        except (wb.ModelLoadError, ValueError) as e:
            self.output.append_stdout(f"error: {e}\n")
            return
        self.model = model
        self.status.value = self._status_html()

    def run(self, _=None) -> None:
        from workbench.analysis.text import sample_prompts

        self.output.clear_output()
        if self.model is None:
            self.load()
            if self.model is None:
                return
        prompts = sample_prompts(self.model.tokenizer, self.prompt_len.value, self.batch.value)
        self.progress.max, self.progress.value, self.progress.description = self.new_tokens.value, 0, "running"
        self.run_button.disabled = True

        def on_token(step, ids):
            self.progress.value = step + 1

        try:
            self.result = self.model.generate(prompts, max_new_tokens=self.new_tokens.value,
                                              attention=self.attention.value, kv_cache=self.kv_cache.value,
                                              stop_at_eos=False, on_token=on_token, on_step=self.plots.on_step)
        except ValueError as e:
            self.output.append_stdout(f"error: {e}\n")
            return
        finally:
            self.run_button.disabled = False
            self.progress.description = "done"
        self.plots.update(self.result.timings)  # the final state, whatever the refresh rate skipped
        text = self.result.text[0] if isinstance(self.result.text, list) else self.result.text
        self.output.append_stdout(f"{self.result.summary_line()}\nsequence 0 continues: {text[:300]!r}\n")

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


def panel(model=None) -> Panel:
    """The control panel (display it, or let it be the cell's value)."""
    return Panel(model)
