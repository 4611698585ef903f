"""Every notebook, executed top to bottom by a real Jupyter kernel (nbclient), with its
parameters cell shrunk so CI stays quick; any cell error fails. Notebooks are stored
without outputs, and a newcomer's Run All and save leaves `git status` clean."""

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
    "06-two-real-models": 'PROMPT = "The capital of France is"\nNEW_TOKENS = 8\nROUNDS = 1\nKV_CONTEXT = 32768\n'
                          'QUALITY_CONTEXT = 96\nQUALITY_STEPS = 8',
    "07-weight-formats": 'MODEL = "smollm2-135m"\nFORMATS = ["fp32", "file", "q8_0", "q4_k", "q4_0", "int4-g128"]\n'
                         'CONTEXT = 64\nROUNDS = 1\nNEW_TOKENS = 3\nPROMPT_LEN = 16',
}


def test_every_notebook_has_parameters_and_no_outputs():
    assert {p.stem for p in NOTEBOOKS.glob("*.ipynb")} == set(SMALL)
    for path in NOTEBOOKS.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        assert any("parameters" in c.metadata.get("tags", []) for c in nb.cells), path.name
        assert all(not c.get("outputs") and c.get("execution_count") is None
                   for c in nb.cells if c.cell_type == "code"), f"{path.name} has outputs: strip them"


def _git(repo: Path, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A repository as a newcomer's clone has it after scripts/bootstrap: the notebooks
    committed through the git filter, and a Jupyter configuration, both set up by the script
    bootstrap runs (scripts/setup-notebook-git, here for an environment prefix of the test's
    own: clone/env)."""
    repo = tmp_path_factory.mktemp("clone")
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.invalid")
    _git(repo, "config", "user.name", "t")
    for name in (".gitattributes", ".gitignore"):
        shutil.copy(ROOT / name, repo)
    shutil.copytree(ROOT / "scripts", repo / "scripts")
    shutil.copytree(NOTEBOOKS, repo / "notebooks")
    (repo / ".git" / "info" / "exclude").write_text("env/\n")  # the environment is not the project's
    subprocess.run(["bash", str(repo / "scripts" / "setup-notebook-git"), str(repo / "env")], check=True)
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "the notebooks as stored")
    return repo


def save_as_jupyterlab(repo: Path, nb, path: str) -> None:
    """Save a notebook through jupyter_server's contents manager with the configuration the
    clone's environment has (what its JupyterLab server loads from <prefix>/etc/jupyter):
    what JupyterLab's Save and autosave do, post-save hook included."""
    from jupyter_server.services.contents.filemanager import FileContentsManager
    from traitlets.config.loader import PyFileConfigLoader

    config = PyFileConfigLoader("jupyter_server_config.py", path=str(repo / "env" / "etc" / "jupyter")).load_config()
    manager = FileContentsManager(config=config, root_dir=str(repo))
    assert manager.post_save_hook is not None, "no post-save hook configured: run scripts/bootstrap"
    manager.save({"type": "notebook", "format": "json", "content": nb}, path)


def test_a_run_notebook_leaves_git_status_clean_and_a_real_change_listed(clone):
    """JupyterLab saves outputs into the file; the clean filter strips them, so git sees no
    change in the content, and the server's post-save hook records the file's new size, so
    `git status` does not list it either (git trusts a changed size without filtering). An
    edit of a cell's code stays a change to commit."""
    nb = nbformat.read(clone / "notebooks" / "01-quickstart.ipynb", as_version=4)
    code = next(c for c in nb.cells if c.cell_type == "code")
    code.outputs = [nbformat.v4.new_output("stream", text="Paris\n")]
    code.execution_count = 3
    save_as_jupyterlab(clone, nb, "notebooks/01-quickstart.ipynb")
    assert "Paris" in (clone / "notebooks" / "01-quickstart.ipynb").read_text()
    assert _git(clone, "diff") == "" and _git(clone, "status", "--porcelain") == ""
    code.source += "\n# edited"
    save_as_jupyterlab(clone, nb, "notebooks/01-quickstart.ipynb")
    assert _git(clone, "status", "--porcelain") == " M notebooks/01-quickstart.ipynb\n"  # not staged for the user
    _git(clone, "checkout", "--", "notebooks/01-quickstart.ipynb")


@pytest.mark.parametrize("name", sorted(SMALL))
def test_notebook_runs_in_a_real_kernel(name, clone):
    """Run All in a real kernel, in the notebook's own folder of a clone, then saved as
    JupyterLab saves it: no cell fails, the notebook validates, and `git status` is clean."""
    path = clone / "notebooks" / f"{name}.ipynb"
    nb = nbformat.read(path, as_version=4)
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    stored = params.source
    params.source = SMALL[name]
    # timeout=None: no per-cell time limit; the test checks what the cells produce, not how fast.
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=None,
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError on any failing cell
    nbformat.validate(nb)
    params.source = stored  # the run's smaller sizes are this test's, not an edit to keep
    save_as_jupyterlab(clone, nb, f"notebooks/{name}.ipynb")
    assert _git(clone, "status", "--porcelain") == "", f"{name}: Run All then save left git status unclean"
    text = "\n".join(str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", ""))
                     for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "Traceback" not in text
    if name == "04-kv-quality":
        assert "no other format has both fewer bytes and lower KL" in text and "the paper's int8" in text
    if name == "05-cost-model":
        assert "the paper's 8-socket latency implies" in text and "predicted / paper" in text
    if name == "06-two-real-models":  # both models ran; Gemma's rings: 3 full layers of 18 at 32K
        assert "gemma3-270m: 'The capital of France is' -> '" in text and "smollm2-135m: 'The capital" in text
        assert "gemma3" in text and "15 of 18 (512 tokens)" in text and "18%" in text
    if name == "01-quickstart":
        assert "Paris" in text and "tokens/s (all sequences)" in text  # the timings' readable repr
