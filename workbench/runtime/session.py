"""The model a notebook is working with, shared by the magics and the control panel.

`%load_model` puts the model here; a panel opened without a model follows it, whichever
was opened first. The switches live on the model itself (Model.on_switch tells listeners
when they change), so `%kvcache int8` and the panel's KV toggle are one state."""

from __future__ import annotations

import time
from typing import Callable

from workbench.hw.load import machine_load


class Session:
    def __init__(self):
        self._model = None
        self._listeners: list[Callable] = []
        # Runs measured by the panel, waiting for the report layer (workbench.report, a floor
        # below this one) to take them into the session's report, in order, as it records.
        self.measured: list[dict] = []

    def add_measurement(self, result, model, command: str, prompt: str | None = None) -> None:
        """A generation measured outside the magics (the panel), for %report, with the time and
        the machine's load now (not when the report is written)."""
        self.measured.append({"result": result, "model": model, "command": command, "prompt": prompt,
                              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "load": machine_load()})

    def add_rows(self, rows: list[dict], kind: str, command: str) -> None:
        """Rows measured outside the magics (the panel's serve-bench), for %report."""
        self.measured.append({"rows": rows, "kind": kind, "command": command,
                              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "load": machine_load()})

    @property
    def model(self):
        return self._model

    @model.setter
    def model(self, model) -> None:
        self._model = model
        for listener in list(self._listeners):
            listener(model)

    def on_model(self, listener: Callable) -> None:
        """listener(model) after every change of the current model."""
        self._listeners.append(listener)


current = Session()
