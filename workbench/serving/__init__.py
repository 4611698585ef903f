"""Serving experiments: a continuous-batching scheduler with chunked prefill and prompt-
prefix reuse over one model (scheduler.py)."""

from workbench.serving.scheduler import QueueFull, Request, Sampling, Scheduler

__all__ = ["QueueFull", "Request", "Sampling", "Scheduler"]
