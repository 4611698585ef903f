"""%profile as a user runs it: a real IPython process profiling itself with py-spy, our C++
kernels named in the native frames, the speedscope file saved and the report holding it;
where ptrace is not permitted, a clear message and no hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

IPYTHON = str(Path(sys.executable).with_name("ipython"))


def ipython(script: str, tmp_path: Path, env: dict | None = None, timeout: int = 300):
    """A real IPython session fed line by line, as typed: an error does not end it."""
    return subprocess.run([IPYTHON, "--no-banner", "--colors=nocolor", "--simple-prompt"], input=script,
                          capture_output=True, text=True, cwd=tmp_path, env={**os.environ, **(env or {})},
                          timeout=timeout)


def test_profile_magic_names_our_kernels_and_joins_the_report(tmp_path):
    pytest.importorskip("IPython")
    r = ipython("""
%load_ext workbench
%load_model smollm2-135m
%profile --native --rate 200 -o prof.json wb_model.generate("The capital of France is", max_new_tokens=16)
import json
frames = [f["frame"] for f in wb_profile["top_frames"]]
print("FRAMES", json.dumps(frames))
%report -o report.html
""", tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "hottest frames by self time" in r.stdout and f"speedscope JSON: {tmp_path / 'prof.json'}" in r.stdout
    frames = json.loads(r.stdout.split("FRAMES ", 1)[1].splitlines()[0])
    data = json.loads((tmp_path / "prof.json").read_text())
    names = {f["name"] for f in data["shared"]["frames"]}
    # our kernels by name (native frames, symbols from the -g build) and the Python that called them
    assert any("wbk::" in n or "matvec" in n for n in names), sorted(names)[:50]
    assert any(n.startswith("Model.generate") or n == "generate" for n in names)
    assert frames  # the hottest frames table was computed from the same file
    report = json.loads((tmp_path / "report.json").read_text())
    prof = [e for e in report["entries"] if e["kind"] == "profile"]
    assert len(prof) == 1 and prof[0]["speedscope"] == str(tmp_path / "prof.json") and prof[0]["top_frames"]
    assert "Entry 0: profile" in (tmp_path / "report.html").read_text()


def test_profile_without_ptrace_permission_says_what_to_change(tmp_path):
    """The kernel made non-dumpable and py-spy run without CAP_SYS_PTRACE: it cannot attach.
    An earlier profile's file where this one would go (the results folder's default name) is
    not taken for this one's."""
    if not Path("/usr/bin/setpriv").is_file():
        pytest.skip("needs setpriv (util-linux) to drop CAP_SYS_PTRACE")
    py_spy = Path(sys.executable).with_name("py-spy")
    results = tmp_path / "results"
    results.mkdir()
    (results / "profile.speedscope.json").write_text(json.dumps({"shared": {"frames": []}, "profiles": []}))
    env = {"WORKBENCH_PY_SPY": f"/usr/bin/setpriv --bounding-set=-sys_ptrace --inh-caps=-sys_ptrace {py_spy}",
           "WORKBENCH_RESULTS_DIR": str(results)}
    r = ipython("""
import ctypes
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: only CAP_SYS_PTRACE may attach
%load_ext workbench
%profile --rate 100 sum(range(10))
print("STILL ALIVE", 1 + 1)
""", tmp_path, env, timeout=120)
    out = r.stdout + r.stderr
    assert "UsageError" in out and "ptrace is not permitted" in out and "SYS_PTRACE" in out and "ptrace_scope" in out
    assert "Traceback" not in out  # one line, not a stack
    assert "STILL ALIVE 2" in r.stdout  # the session goes on


def test_a_profile_py_spy_could_not_write_is_a_clear_error(tmp_path):
    """py-spy attaches and samples, then cannot write its file (here the output path is a
    directory): the error says so and what py-spy said, not a FileNotFoundError from reading it."""
    from workbench.analysis.profile import ProfilerUnavailable, profile

    out = tmp_path / "taken.json"
    out.mkdir()
    with pytest.raises(ProfilerUnavailable, match="py-spy wrote no profile of pid"):
        profile(lambda: sum(range(10)), rate=100, out=out)


def test_profile_bad_arguments(tmp_path):
    r = ipython("""
%load_ext workbench
%profile --rate 0 sum(range(3))
%profile
""", tmp_path, timeout=120)
    out = r.stdout + r.stderr
    assert "rate must be an integer number of samples per second in [1, 10000], got 0" in out
    assert "%profile needs a statement" in out


def test_workbench_profile_command(tmp_path):
    out = tmp_path / "cli.json"
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "profile", "--rate", "100", "--out", str(out), "--",
                        "generate", "Hello", "--max-new-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert out.is_file() and "hottest frames" in r.stdout
    names = {f["name"] for f in json.loads(out.read_text())["shared"]["frames"]}
    assert any("generate" in n for n in names)


def test_profile_a_distributed_run_samples_the_engines_too(tmp_path):
    """With a cluster running, %profile attaches to every engine as well and summarises each."""
    r = ipython("""
%load_ext workbench
%distributed start -n 2 --backend shm
%load_model smollm2-135m
%profile --rate 100 -o prof.json wb_model.generate("Hello", max_new_tokens=8)
print("ENGINES", sorted(wb_profile["engines"]))
%distributed stop
""", tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ENGINES [0, 1]" in r.stdout
    for rank in (0, 1):
        data = json.loads((tmp_path / f"prof.rank{rank}.json").read_text())
        names = {f["name"] for f in data["shared"]["frames"]}
        assert any("generate" in n or "decode" in n for n in names), sorted(names)[:40]  # the engine's own work
