"""Every notebook, executed top to bottom by a real Jupyter kernel (nbclient), with its
parameters cell shrunk so CI stays quick; any cell error fails. Notebooks are stored
without outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
SMALL = {
    "01-quickstart": 'MODEL = "smollm2-135m"\nNEW_TOKENS = 4\nABLATE_PROMPT_LEN = "24"\nABLATE_NEW_TOKENS = 3',
    "02-slimattention-vs-flashattention": "NS = [128, 256]\nREPEATS = 1\nPROMPT_LEN = 32",
    "03-int8-kv-cache": "BATCH = 2\nLENGTH = 256\nREPEATS = 1\nPROMPT_LEN = 32\nNEW_TOKENS = 4",
}


def test_every_notebook_has_parameters_and_no_outputs():
    assert {p.stem for p in NOTEBOOKS.glob("*.ipynb")} == set(SMALL)
    for path in NOTEBOOKS.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        assert any("parameters" in c.metadata.get("tags", []) for c in nb.cells), path.name
        assert all(not c.get("outputs") and c.get("execution_count") is None
                   for c in nb.cells if c.cell_type == "code"), f"{path.name} has outputs: strip them"


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
    if name == "01-quickstart":
        assert "Paris" in text and "decode_tokens_per_s" in text
