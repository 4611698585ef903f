"""README's commands and example stay true."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_python_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert blocks, "README has no python example"
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})


def test_ci_runs_the_test_command_that_readme_gives():
    test_command = ".venv/bin/python -m pytest tests"
    assert f"bash scripts/bootstrap && {test_command}" in README
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/bootstrap" in ci and test_command in ci


def test_main_job_is_the_demo_command():
    assert "bash scripts/bootstrap && .venv/bin/workbench demo" in README
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "demo", "--help"], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 0 and "--long-tokens" in r.stdout
