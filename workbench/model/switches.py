"""The switches a generation runs with, checked against the registries: which attention
backend (workbench.model.attention) and which KV-cache format (workbench.model.kv_formats).
Changing them never touches the weights."""

from __future__ import annotations

from dataclasses import dataclass

from workbench.model.attention import attention_backend
from workbench.model.kv_formats import kv_format


@dataclass(frozen=True)
class Switches:
    attention: str = "slim"
    kv_cache: str = "fp32"

    def __post_init__(self):
        attention_backend(self.attention)  # each raises a ValueError naming the accepted values
        kv_format(self.kv_cache)
