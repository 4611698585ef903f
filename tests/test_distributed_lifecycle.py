"""Tensor-parallel clusters started and stopped by the test itself: the random 7B preset,
an engine killed mid-generation, argument errors. (tests/test_distributed.py keeps one
cluster per backend for its module; these need none running.)"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

pytest.importorskip("ipyparallel")

import workbench as wb  # noqa: E402
from workbench.distributed.cluster import Cluster, DistributedError, _alive  # noqa: E402

PROMPT = "The capital of France is"
pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs for 2 ranks")


@pytest.fixture(scope="module")
def single():
    return wb.load_model("smollm2-135m")


def test_random_7b_preset_two_layers_matches_tp1():
    single = wb.load_model("llama2-7b", random=True, layers=2, max_seq_len=128)
    ids = single.tokenizer.encode("The workbench measures tensor parallelism")
    ref_logits, ref = single.logits(ids), single.generate(ids, max_new_tokens=8, stop_at_eos=False).token_ids
    del single
    cluster = Cluster(2, backend="shm").start()
    try:
        model = cluster.load_model("llama2-7b", random=True, layers=2, max_seq_len=128)
        logits = model.logits(ids)
        assert (logits - ref_logits).abs().max() <= 1e-4 * ref_logits.abs().max()
        assert model.generate(ids, max_new_tokens=8, stop_at_eos=False).token_ids == ref
    finally:
        cluster.stop()


def test_a_killed_engine_is_a_clear_error_and_nothing_is_left(single):
    cluster = Cluster(2, backend="shm", timeout_s=5).start()
    model = cluster.load_model("smollm2-135m")
    pids = [e["pid"] for e in cluster.engines]
    controller = cluster.ipp_cluster.controller.process.pid
    victim = cluster.engines[1]["pid"]
    killed = {}

    def kill_rank_1(step, ids):
        if step == 3 and not killed:
            os.kill(victim, signal.SIGKILL)
            killed["at"] = time.monotonic()

    with pytest.raises(DistributedError, match="rank 1") as e:
        model.generate(PROMPT, max_new_tokens=400, stop_at_eos=False, on_token=kill_rank_1)
    assert time.monotonic() - killed["at"] < 10
    assert "stopped" in str(e.value)
    assert not any(_alive(p) for p in pids + [controller])  # no orphan engine or controller
    assert not cluster.running and not cluster.shm_path.exists()
    assert "Paris" in single.generate(PROMPT, max_new_tokens=4).text  # the single-process model still works
    Cluster(2, backend="gloo").start().stop()  # and a new cluster can start


def test_bad_cluster_arguments_are_clear():
    with pytest.raises(ValueError, match="positive integer"):
        Cluster(0)
    with pytest.raises(ValueError, match="oversubscribe"):
        Cluster(2, threads_per_rank=len(os.sched_getaffinity(0)))
    with pytest.raises(ValueError, match="backend must be one of gloo, shm"):
        Cluster(2, backend="nccl")
    with pytest.raises(ValueError, match="launcher"):
        Cluster(2, launcher="kubernetes")
    cluster = Cluster(1, backend="gloo").start()
    try:
        with pytest.raises(DistributedError, match="already running"):
            Cluster(1).start()
    finally:
        cluster.stop()
    assert torch.get_num_threads() >= 1
