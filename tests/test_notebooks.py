"""Every notebook, executed top to bottom by a real Jupyter kernel (nbclient), with its
parameters cell shrunk so CI stays quick; any cell error fails. Notebooks are stored
without outputs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
SMALL = {
    "01-quickstart": 'MODEL = "smollm2-135m"\nNEW_TOKENS = 4\nABLATE_PROMPT_LEN = "24"\nABLATE_NEW_TOKENS = 3',
    "02-slimattention-vs-flashattention": "NS = [128, 256]\nREPEATS = 1\nPROMPT_LEN = 32",
    "03-int8-kv-cache": "BATCH = 2\nLENGTH = 256\nREPEATS = 1\nCONTEXT = 128\nSTEPS = 8",
    "04-kv-quality": 'CONTEXTS = [96, 160]\nSTEPS = 8\nFORMATS = ["fp32", "int8:widen", "int8:dot", "int8:tile", "int8-kivi", "int4-kivi"]',
    "05-cost-model": "NEW_TOKENS = 6\nPROMPT_LEN = 16\nSEVEN_B_LAYERS = 1",
}


def test_every_notebook_has_parameters_and_no_outputs():
    assert {p.stem for p in NOTEBOOKS.glob("*.ipynb")} == set(SMALL)
    for path in NOTEBOOKS.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        assert any("parameters" in c.metadata.get("tags", []) for c in nb.cells), path.name
        assert all(not c.get("outputs") and c.get("execution_count") is None
                   for c in nb.cells if c.cell_type == "code"), f"{path.name} has outputs: strip them"


def test_a_run_notebook_does_not_dirty_the_repository(tmp_path):
    """JupyterLab autosaves outputs into the file; the clean filter that .gitattributes names
    and scripts/bootstrap registers strips them, so git sees no change in the content and
    nothing to commit. (`git status` may list the file until the index's size stamp is
    refreshed, as with any clean filter: `git add` or `git update-index --refresh`.)"""
    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    git("config", "user.email", "t@example.invalid")
    git("config", "user.name", "t")
    shutil.copy(ROOT / ".gitattributes", tmp_path)
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    shutil.copy(NOTEBOOKS / "01-quickstart.ipynb", tmp_path)
    bootstrap = (ROOT / "scripts" / "bootstrap").read_text()
    command = bootstrap.split('git config filter.strip-notebook-outputs.clean "', 1)[1].split('"', 1)[0]
    git("config", "filter.strip-notebook-outputs.clean", command)  # what bootstrap does
    git("add", ".")
    git("commit", "-qm", "notebook")
    nb = nbformat.read(tmp_path / "01-quickstart.ipynb", as_version=4)
    code = next(c for c in nb.cells if c.cell_type == "code")
    code.outputs = [nbformat.v4.new_output("stream", text="Paris\n")]
    code.execution_count = 3
    nbformat.write(nb, tmp_path / "01-quickstart.ipynb")
    assert "Paris" in (tmp_path / "01-quickstart.ipynb").read_text()
    assert git("diff") == ""
    git("add", "-A")
    assert git("status", "--porcelain") == ""  # nothing to commit: the outputs never reach the index


@pytest.mark.parametrize("name", sorted(SMALL))
def test_notebook_runs_in_a_real_kernel(name, tmp_path):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    params.source = SMALL[name]
    # timeout=None: no per-cell time limit; the test checks what the cells produce, not how fast.
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=None, resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError on any failing cell
    text = "\n".join(str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", ""))
                     for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "Traceback" not in text
    if name == "04-kv-quality":
        assert "no other format has both fewer bytes and lower KL" in text and "the paper's int8" in text
    if name == "05-cost-model":
        assert "the paper's 8-socket latency implies" in text and "predicted / paper" in text
    if name == "01-quickstart":
        assert "Paris" in text and "tokens/s (all sequences)" in text  # the timings' readable repr
