"""The per-machine cache files (peaks, prefetch, crossovers, all-reduce fits) are written whole
or not at all: the ranks of a tensor-parallel run measure and write the same file at once, and
another process may be reading it meanwhile."""

from __future__ import annotations

import json
import subprocess
import sys

from workbench.cache import write_json

WRITER = """
import sys
from pathlib import Path
from workbench.cache import write_json
path, tag = Path(sys.argv[1]), sys.argv[2]
for i in range(300):
    write_json(path, {"writer": tag, "values": [tag * 8] * (2000 if tag == "a" else 3000)})
"""


def test_concurrent_writers_leave_one_whole_version_for_every_reader(tmp_path):
    path = tmp_path / "sub" / "measured.json"  # the folder is made too
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), tag]) for tag in ("a", "b")]
    seen, reads = set(), 0
    try:
        while any(w.poll() is None for w in writers):
            try:
                text = path.read_text()
            except FileNotFoundError:  # before the first rename
                continue
            found = json.loads(text)  # a half-written or interleaved file would not parse
            assert found["values"] == [found["writer"] * 8] * (2000 if found["writer"] == "a" else 3000)
            seen.add(found["writer"])
            reads += 1
    finally:
        for w in writers:
            w.wait(timeout=60)
    assert [w.returncode for w in writers] == [0, 0]
    assert reads > 0 and seen <= {"a", "b"}
    assert json.loads(path.read_text())["writer"] in {"a", "b"}
    assert [p.name for p in path.parent.iterdir()] == ["measured.json"]  # no temporary file left


def test_a_failed_write_leaves_the_previous_version(tmp_path):
    path = tmp_path / "measured.json"
    write_json(path, {"v": 1})
    try:
        write_json(path, {"v": object()})  # not JSON: the write fails before the rename
    except TypeError:
        pass
    else:
        raise AssertionError("an unserialisable value was written")
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["measured.json"]
