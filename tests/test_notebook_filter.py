"""The git filter that stores notebooks (scripts/strip_notebook_outputs.py): what JupyterLab
changes when it runs and saves a notebook (outputs, execution counts, widget state, the
kernelspec's display name, language_info with the running Python's version) is stripped
back to the stored form, so Run All leaves nothing to commit."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("strip_notebook_outputs", ROOT / "scripts" / "strip_notebook_outputs.py")
strip_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(strip_module)


def test_a_saved_run_strips_back_to_the_stored_notebook():
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        stored = path.read_text()
        nb = json.loads(stored)
        ran = copy.deepcopy(nb)  # what JupyterLab writes after Run All
        ran["metadata"]["kernelspec"]["display_name"] = "Python 3"
        ran["metadata"]["language_info"] = {"name": "python", "version": "3.11.7", "mimetype": "text/x-python",
                                            "codemirror_mode": {"name": "ipython", "version": 3}}
        ran["metadata"]["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
        for i, cell in enumerate(c for c in ran["cells"] if c["cell_type"] == "code"):
            cell["execution_count"] = i + 1
            cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["x\n"]}]
            cell.setdefault("metadata", {})["execution"] = {"iopub.status.busy": "2026-12-01T00:00:00"}
        assert strip_module.dumps(strip_module.strip(ran)) == stored, path.name
