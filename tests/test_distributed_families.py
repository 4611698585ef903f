"""Tensor parallel for every family: a 2-engine cluster (shm) loads each family's tiny random
model (tests/tiny_models.py: Qwen2's biases split with their rows, Qwen3's and Gemma's per-head
norms and Gemma's post norms whole on each rank, windows as rings on each rank) and Gemma 3
270M from its package (one KV head: both ranks hold it, the first computes it and hands it to
the second), and gives the same greedy tokens as one process."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("ipyparallel")
pytest.importorskip("transformers")

import workbench as wb  # noqa: E402
from tiny_models import FAMILIES, save_tiny  # noqa: E402
from workbench.distributed.cluster import Cluster  # noqa: E402
from workbench.model.loaders import gguf_tokenizer  # noqa: E402

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs for 2 ranks")


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(2, backend="shm", pin=True, timeout_s=60).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tokenizer = gguf_tokenizer()
    out = {}
    for family in FAMILIES:
        out[family] = tmp_path_factory.mktemp(family)
        save_tiny(family, out[family], tokenizer)
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_two_ranks_give_one_process_tokens(cluster, folders, family):
    path = str(folders[family])
    single = wb.load_model(path, max_seq_len=256)
    model = cluster.load_model(path, max_seq_len=256)
    prompt = single.tokenizer.encode("Licensed under the Apache License, Version 2.0 (the License); you may not "
                                     "use this file except in compliance with the License.")
    assert len(prompt) > 24  # past Gemma's window
    ours = model.generate(prompt, max_new_tokens=16, stop_at_eos=False)
    ref = single.generate(prompt, max_new_tokens=16, stop_at_eos=False)
    assert ours.token_ids == ref.token_ids, family
    assert all(s.path == "fused" for s in ours.timings.decode_steps)
    two = model.generate([prompt, prompt[:9]], max_new_tokens=6, stop_at_eos=False)
    assert two.token_ids == single.generate([prompt, prompt[:9]], max_new_tokens=6, stop_at_eos=False).token_ids


def test_gemma3_270m_on_two_ranks(cluster):
    """Its single KV head is held by both ranks; with the handoff on (shm), the first rank
    computes it and hands it over, the second's computation of it skipped."""
    single = wb.load_model("gemma3-270m")
    model = cluster.load_model("gemma3-270m")
    assert [tuple(s["kv_heads"]) for s in model.shards] == [(0, 1), (0, 1)]
    assert [tuple(s["kv_handoff"]) for s in model.shards] == [(False, True), (True, False)]
    for handoff in (False, True):
        model.set_options(kv_handoff=handoff)
        ours = model.generate("The capital of France is", max_new_tokens=16, stop_at_eos=False)
        ref = single.generate("The capital of France is", max_new_tokens=16, stop_at_eos=False)
        assert ours.token_ids == ref.token_ids, handoff
