"""Every magic README lists, run the way a notebook runs it: a real ipykernel driven by
nbclient, so an event loop is running around each cell and figures go through the kernel's
display publisher (the plain-IPython tests in test_magics.py have neither). Each magic's
`%magic?` help comes back whole; every cell runs without an error; the figures are plotly
outputs; the notebook as saved validates against nbformat's schema; %report and %profile
write outside the kernel's working folder and say where, absolutely.

Each cell below was a defect a new user met in JupyterLab (issue 59): %serve_bench's
asyncio.run inside the kernel's loop, figures displayed as whole output dicts (nothing drawn,
the saved notebook invalid), %threads without an argument, %distributed stop unloading the
model, %report writing into notebooks/results/.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
PLOTLY = "application/vnd.plotly.v1+json"
PROMPT = "The capital of France is"


def readme_magics() -> list[str]:
    """The magics README's table lists (its first column)."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## The magics at a glance"):text.index("From Python the same is a library")]
    return list(dict.fromkeys(re.findall(r"^\| `%(\w+)", table, re.M) + re.findall(r", `%(\w+)", table)))


# (source, what its output must show); the figures' cells are named for the checks below.
CELLS = [
    ("%load_ext workbench", None),
    ("%load_model smollm2-135m", "smollm2-135m"),
    ("%attention slim\n%attention", "attention = slim"),
    ("%kvcache int8\n%kvcache", "kv_cache = int8"),
    ("%threads", "threads = "),
    ("%threads 2", "threads = 2"),
    (f"%generate -n 4 {PROMPT}", "Paris"),
    ("%ablate --attention slim,naive --kvcache int8 --prompt-len 16 --new-tokens 2 --repeats 1 -o df", "top1_agreement"),
    ("%kv_quality --formats fp32,int8 --context 96 --steps 8 -o kvq", "best per byte"),
    ("%weight_quality --formats fp32,q4_0,int4-g32 --context 64 --rounds 1 --new-tokens 3 --prompt-len 16 -o wq",
     "Pareto front"),
    (f"%profile --rate 100 wb_model.generate('{PROMPT}', max_new_tokens=4)", "hottest frames"),
    ("%serve start --slots 2 --max-len 256", "serving at http://127.0.0.1:"),
    ("%serve status", "serving at"),
    ("%serve_bench --rate 20,40 --num-requests 3 --prompt-tokens 8 --max-tokens 3 -o sb", "TTFT ms p50/p90/p99"),
    ("%serve stop", "stopped"),
    ("%distributed stop", "no cluster was running; the model stays"),
    ("%workbench", "smollm2"),
    ("%distributed start -n 2 --backend gloo", "now %load_model loads on every engine"),
    ("%distributed status", "rank 1: pid"),
    ("%load_model smollm2-135m", "tensor parallel over 2 ranks"),
    (f"%generate -n 3 {PROMPT}", "Paris"),
    ("%distributed stop", "cluster stopped; loaded: "),
    ("%report", "wrote /"),
    ("%workbench --panel", None),
]
FIGURES = {"%ablate": 1, "%kv_quality": 1, "%weight_quality": 1, "%profile": 1, "%serve_bench": 1}


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """The notebook executed in a real kernel whose working folder is empty: (the notebook as
    saved and read back, the help each `%magic?` cell returned, that folder)."""
    work = tmp_path_factory.mktemp("kernel-cwd")
    magics = readme_magics()
    cells = [f"%{m}?" for m in magics] + [source for source, _ in CELLS]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.cells.insert(0, nbformat.v4.new_code_cell("%load_ext workbench"))  # for the help cells
    helps = {}

    def keep_help(cell, cell_index, execute_reply):
        pages = [p["data"]["text/plain"] for p in execute_reply["content"].get("payload", [])
                 if p.get("source") == "page"]
        if cell.source.endswith("?"):
            helps[cell.source[1:-1]] = "".join(pages)

    # allow_errors: every cell runs and each error is an output, so one failing magic does not
    # hide the next (test_every_magic_runs_without_an_error lists them all)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=None, on_cell_executed=keep_help,
                                     allow_errors=True, resources={"metadata": {"path": str(work)}})
    client.execute()
    saved = work.parent / "saved.ipynb"
    saved.write_text(json.dumps(nb))  # unvalidated: the validity is a test's to judge
    return nbformat.from_dict(json.loads(saved.read_text())), helps, work


def _text(cell) -> str:
    return "".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) for o in cell.outputs)


def test_readme_lists_the_magics_this_test_runs():
    assert set(readme_magics()) == {"load_model", "attention", "kvcache", "threads", "generate", "ablate", "kv_quality",
                                    "weight_quality", "distributed", "serve", "serve_bench", "profile", "report", "workbench"}
    ran_here = {re.match(r"%(\w+)", source).group(1) for source, _ in CELLS}
    assert set(readme_magics()) <= ran_here


def test_every_magics_help_comes_back_whole(ran):
    _, helps, _ = ran
    assert set(helps) == set(readme_magics())
    for name, text in helps.items():
        assert f"%{name}" in text and "Examples::" in text, name
        assert "option_strings" not in text and "{'" not in text, (name, text)  # argparse's internals
    options = helps["serve_bench"][helps["serve_bench"].index("options:"):]
    url = " ".join(options[options.index("--url URL"):].split())
    assert url.startswith("--url URL the server (default: the one %serve started)"), url
    for default in ("(default 8)", "(default 32)", "(default 64)"):
        assert default in " ".join(helps["serve_bench"].split())


def test_every_magic_runs_without_an_error(ran):
    nb, _, _ = ran
    errors = [(c.source, o.get("ename"), o.get("evalue")) for c in nb.cells for o in c.outputs
              if o.output_type == "error"]
    assert errors == []
    for cell, (source, expected) in zip(nb.cells[-len(CELLS):], CELLS):  # CELLS are the notebook's last cells
        assert cell.source == source
        if expected:
            assert expected in _text(cell), (source, _text(cell)[-800:])


def test_figures_are_plotly_outputs_and_the_saved_notebook_is_valid(ran):
    nb, _, _ = ran
    nbformat.validate(nb)  # raises ValidationError: what JupyterLab logged at every autosave
    for prefix, n in FIGURES.items():
        cell = next(c for c in nb.cells if c.source.startswith(prefix + " "))
        figures = [o for o in cell.outputs if o.output_type == "display_data" and PLOTLY in o.data]
        assert len(figures) == n, (prefix, [o.output_type for o in cell.outputs])
        assert figures[0].data[PLOTLY]["data"] and figures[0].metadata == {}
    assert "no run yet" in json.dumps([o.get("data") for o in nb.cells[-1].outputs])  # the panel's view


def test_outputs_go_outside_the_kernels_folder_and_are_named_absolutely(ran):
    """A notebook's kernel runs in its folder (notebooks/ in the source tree): %report and
    %profile once wrote results/ there and said only "wrote results/report.html"."""
    from workbench.cache import results_dir

    nb, _, work = ran
    assert list(work.iterdir()) == []
    report = _text(next(c for c in nb.cells if c.source == "%report"))
    html = Path(re.search(r"wrote (\S+\.html)", report).group(1))
    assert html.is_absolute() and html == results_dir() / "report.html" and html.is_file()
    profile = _text(next(c for c in nb.cells if c.source.startswith("%profile ")))
    speedscope = Path(re.search(r"speedscope JSON: (\S+)", profile).group(1))
    assert speedscope.is_absolute() and speedscope.parent == results_dir() and speedscope.is_file()


def test_serve_takes_the_usual_port_or_says_why_not(ran):
    from workbench.serving.process import DEFAULT_PORT

    nb, _, _ = ran
    said = _text(next(c for c in nb.cells if c.source.startswith("%serve start")))
    assert f"127.0.0.1:{DEFAULT_PORT} " in said or f"port {DEFAULT_PORT} is in use" in said, said
