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


def test_docs_python_examples_run():
    """Every python block of docs/ runs as written (each page's blocks in order, one namespace
    per page)."""
    ran = 0
    for page in sorted((ROOT / "docs").glob("*.md")):
        namespace = {}
        for code in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            exec(compile(code, str(page.relative_to(ROOT)), "exec"), namespace)
            ran += 1
    assert ran >= 2


def test_readme_is_a_front_door():
    """Under 200 lines; its links to docs/ resolve."""
    assert len(README.splitlines()) < 200
    for link in re.findall(r"\]\((docs/[^)]+)\)", README):
        assert (ROOT / link).is_file(), link


def test_layout_names_every_module_and_folder():
    """README's Layout names every module and folder of the package, every C++ source, every
    notebook and benchmark."""
    layout = README[README.index("## Layout"):]
    words = set(re.findall(r"[\w.-]+", layout))
    missing = []
    for path in sorted((ROOT / "workbench").rglob("*")):
        if "__pycache__" in path.parts or path.name == "__init__.py" and path.parent.name != "kernels":
            continue
        if path.is_dir() or path.suffix in (".py", ".json"):
            if path.stem not in words and path.name not in words:
                missing.append(str(path.relative_to(ROOT)))
    for folder, pattern in (("kernels", "*"), ("bench", "*.py"), ("notebooks", "*.ipynb")):
        for path in sorted((ROOT / folder).glob(pattern)):
            name = path.stem if folder == "notebooks" else path.name
            if name not in words and path.stem not in words:
                missing.append(str(path.relative_to(ROOT)))
    assert missing == []


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
