"""Notebooks as users run them.

    python bench/notebooks.py [names...]       wall time of each notebook executed top to
                                               bottom by a real kernel, at its own (full-size)
                                               parameters: the quickstart should run in under
                                               3 minutes
    python bench/notebooks.py --generate-speed [--rounds 5] [--new-tokens 64]
                                               decode tokens/s of the same generation in each
                                               place a user runs it, interleaved round by round

--generate-speed answers "why is the notebook slower?" (a JupyterLab kernel decoded at about
half the tokens/s of `ipython` on a 2-core machine). Four places, each started once and
loaded with the bundled model, then, every round in a fresh order, each runs `%generate`
(tokens streamed as text), the same stream flushed at every token (as %generate did before),
a direct `wb_model.generate` (no output), and `%generate` on one thread fewer than the CPUs:

    ipython      an IPython shell (the terminal case), fed through a pipe
    kernel       an ipykernel with no frontend: the kernel alone, its threads and its loop
    jupyterlab   the same kernel under a JupyterLab server with the notebook open in a headless
                 Chromium, the generation run as a cell: what a user has

Besides tokens/s, each run says where the machine's CPU time went while it ran: the kernel's
(or the shell's) process, the browser's processes, the Jupyter server, and everything else;
that is where the cause shows. Medians with min-max over the rounds; the machine's load
(uptime) before and after is printed and written with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_table, spread, write_results  # noqa: E402
import nbclient  # noqa: E402
import nbformat  # noqa: E402

from workbench.hw.load import TICKS, cpu_ticks, descendants  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PROMPT = "The capital of France is"


def notebook_wall_times(names: list[str]) -> None:
    rows = []
    for name in names:
        nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
        t0 = time.perf_counter()
        nbclient.NotebookClient(nb, kernel_name="python3", timeout=1800).execute()
        seconds = time.perf_counter() - t0
        rows.append({"notebook": name, "seconds": f"{seconds:.1f}"})
        print(f"{name}: {seconds:.1f} s", flush=True)
    print_table(rows, ["notebook", "seconds"], title="Notebooks, executed by a real kernel at full parameters")
    write_results("notebooks", {"rows": rows})


# -- where the CPU time goes -------------------------------------------------------------------

def cpu_used(before: dict, after: dict, groups: dict[str, set[int]]) -> dict[str, float]:
    """CPU seconds each group of processes used between two snapshots; "other" is the rest
    (this script's own process included)."""
    used = {name: 0.0 for name in groups}
    used["other"] = 0.0
    for pid, (_, ticks, _) in after.items():  # workbench.hw.load.cpu_ticks() tables
        delta = (ticks - before[pid][1] if pid in before else ticks) / TICKS
        group = next((name for name, pids in groups.items() if pid in pids), "other")
        used[group] += max(0.0, delta)
    return used


# -- the places a generation runs --------------------------------------------------------------

def statements(new_tokens: int) -> dict[str, str]:
    """The runs, each printing its decode tokens/s on a line of its own."""
    cpus = len(os.sched_getaffinity(0))
    generate = f"%generate -n {new_tokens} --ignore-eos {PROMPT}\nprint('TPS', wb_result.timings.decode_tokens_per_s, flush=True)"
    runs = {"%generate": generate,
            # what %generate did before TextStream left a kernel's stream to send on its own clock
            "%generate, a flush per token": "import sys\nfrom workbench.runtime.streaming import TextStream\n"
                                            "_s = TextStream(wb_model.tokenizer)\n"
                                            f"_r = wb_model.generate({PROMPT!r}, max_new_tokens={new_tokens}, "
                                            "stop_at_eos=False, on_token=lambda step, ids: (_s(step, ids), "
                                            "sys.stdout.flush()))\n"
                                            "print('TPS', _r.timings.decode_tokens_per_s, flush=True)",
            "direct": f"_r = wb_model.generate({PROMPT!r}, max_new_tokens={new_tokens}, stop_at_eos=False)\n"
                      "print('TPS', _r.timings.decode_tokens_per_s, flush=True)"}
    if cpus > 1:
        runs[f"%generate, {cpus - 1} thread(s)"] = f"%threads {cpus - 1}\n{generate}\n%threads {cpus}"
    return runs


SETUP = "%load_ext workbench\n%load_model smollm2-135m"


class IPythonShell:
    """`ipython` fed through a pipe, its output read until the line a statement prints."""

    name = "ipython"

    def start(self) -> None:
        ipython = str(Path(sys.executable).with_name("ipython"))
        self.proc = subprocess.Popen([ipython, "--simple-prompt", "--no-banner", "--colors=nocolor"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1)
        self.run(SETUP + "\nprint('TPS', 0, flush=True)")

    def processes(self) -> dict[str, set[int]]:
        return {"shell or kernel": descendants(self.proc.pid, cpu_ticks())}

    def run(self, code: str) -> float:
        # one line per statement: the shell runs each as typed (a blank line ends a block)
        self.proc.stdin.write("\n".join(code.splitlines()) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if "TPS " in line:
                return float(line.split("TPS ", 1)[1].split()[0])
        raise RuntimeError("ipython exited")

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class Kernel:
    """An ipykernel with no frontend (jupyter_client)."""

    name = "kernel"

    def start(self) -> None:
        import jupyter_client

        self.km = jupyter_client.KernelManager(kernel_name="python3")
        self.km.start_kernel()
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self.run(SETUP + "\nprint('TPS', 0)")

    def processes(self) -> dict[str, set[int]]:
        return {"shell or kernel": descendants(self.km.provisioner.pid, cpu_ticks())}

    def run(self, code: str) -> float:
        said = []
        reply = self.kc.execute_interactive(code, timeout=600, output_hook=said.append)
        assert reply["content"]["status"] == "ok", reply["content"]
        text = "".join(m["content"].get("text", "") for m in said if m["msg_type"] == "stream")
        return float(text.split("TPS ", 1)[1].split()[0])

    def stop(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


class JupyterLab:
    """A JupyterLab server with a notebook open in headless Chromium (Playwright); each
    statement becomes the source of the notebook's second cell, run as a user runs a cell, its
    output drawn in the page."""

    name = "jupyterlab"

    def start(self) -> None:
        from playwright.sync_api import sync_playwright

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from conftest import CHROMIUM, CHROMIUM_ARGS

        self.work = Path(tempfile.mkdtemp(prefix="bench-lab-"))
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(SETUP), nbformat.v4.new_code_cell("")])
        nb.metadata.kernelspec = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
        nbformat.write(nb, self.work / "speed.ipynb")  # with its kernel named: JupyterLab starts it, no dialog
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.server = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
             "--IdentityProvider.token=bench", f"--ServerApp.root_dir={self.work}", "--allow-root",
             "--LabApp.expose_app_in_browser=True"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        import urllib.request

        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token=bench", timeout=2)
                break
            except OSError:
                time.sleep(0.3)
        self.playwright = sync_playwright().start()
        self.browser = self.playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        self.page = self.browser.new_page(viewport={"width": 1400, "height": 1000})
        self.page.set_default_timeout(600_000)
        self.page.goto(f"{url}/lab/tree/speed.ipynb?token=bench")
        self.page.wait_for_function("() => window.jupyterapp?.shell.currentWidget?.sessionContext?.session?.kernel"
                                    "?.status === 'idle'")
        self._cell(0)

    def processes(self) -> dict[str, set[int]]:
        table = cpu_ticks()
        server = descendants(self.server.pid, table)
        kernel = set()
        for pid in server:
            try:
                if b"ipykernel" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    kernel |= descendants(pid, table)
            except OSError:
                pass
        browser = {pid for pid, (_, _, name) in table.items() if name.startswith(("chrom", "headless"))}
        return {"shell or kernel": kernel, "browser": browser - kernel, "jupyter server": server - kernel - browser}

    def _cell(self, index: int) -> str:
        """Run the notebook's cell `index` (as Shift+Enter would, staying on it); its output's text."""
        self.page.evaluate("""async (i) => { const nb = window.jupyterapp.shell.currentWidget;
            nb.content.activeCellIndex = i; await window.jupyterapp.commands.execute('notebook:run-cell'); }""", index)
        self.page.wait_for_function("""(i) => { const nb = window.jupyterapp.shell.currentWidget;
            const c = nb.content.widgets[i]; return c.model.executionCount !== null && c.model.executionState === 'idle'
                && nb.sessionContext.session.kernel.status === 'idle'; }""", arg=index)
        return self.page.evaluate(
            "(i) => window.jupyterapp.shell.currentWidget.content.widgets[i].outputArea.node.innerText", index)

    def run(self, code: str) -> float:
        self.page.evaluate("""(code) => { const c = window.jupyterapp.shell.currentWidget.content.widgets[1];
            c.model.sharedModel.setSource(code); }""", code)
        text = self._cell(1)
        return float(text.split("TPS ", 1)[1].split()[0])

    def stop(self) -> None:
        self.browser.close()
        self.playwright.stop()
        self.server.terminate()
        self.server.wait(timeout=60)


NEW_TOKENS = 64


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def generate_speed(rounds: int, seed: int = 0) -> None:
    places = [IPythonShell(), Kernel(), JupyterLab()]
    load_before = uptime()
    print(f"before: {load_before}", flush=True)
    for place in places:
        place.start()
        print(f"started {place.name}", flush=True)
    runs = statements(NEW_TOKENS)
    found: dict[tuple[str, str], dict[str, list]] = {}
    rng = random.Random(seed)
    try:
        for r in range(rounds + 1):  # round 0 warms every place up and is not counted
            order = [(p, what) for p in places for what in runs]
            rng.shuffle(order)
            for place, what in order:
                groups = place.processes()
                before, t0 = cpu_ticks(), time.perf_counter()
                tps = place.run(runs[what])
                wall = time.perf_counter() - t0
                used = cpu_used(before, cpu_ticks(), groups)
                if r == 0:
                    continue
                cell = found.setdefault((place.name, what), {"tps": [], "wall": [], **{k: [] for k in used}})
                cell["tps"].append(tps)
                cell["wall"].append(wall)
                for k, v in used.items():
                    cell.setdefault(k, []).append(v / wall)  # CPUs busy on average while it ran
            print(f"  round {r}/{rounds}" + (" (warm-up)" if r == 0 else ""), flush=True)
    finally:
        for place in places:
            place.stop()
    load_after = uptime()
    print(f"after: {load_after}")
    rows = []
    reference = {what: statistics.median(found[("ipython", what)]["tps"]) for what in runs}
    for (name, what), cell in found.items():
        ratios = [t / reference[what] for t in cell["tps"]]
        rows.append({"place": name, "run": what, "decode tokens/s": spread(cell["tps"]),
                     "/ ipython": f"{statistics.median(ratios):.2f}",
                     **{f"CPUs busy: {k}": spread(cell[k], 2) for k in ("shell or kernel", "browser", "jupyter server", "other")
                        if k in cell}})
    columns = ["place", "run", "decode tokens/s", "/ ipython", "CPUs busy: shell or kernel", "CPUs busy: browser",
               "CPUs busy: jupyter server", "CPUs busy: other"]
    print_table(rows, columns, title=f"Decode tokens/s of the same generation ({NEW_TOKENS} new tokens, bundled model) "
                                     f"by place, median (min-max) over {rounds} interleaved rounds; CPUs busy: CPU "
                                     f"seconds per second of the run, by whose processes")
    print_table([{"when": "before", "uptime": load_before}, {"when": "after", "uptime": load_after}], ["when", "uptime"],
                title="The machine's load around the run (uptime); CPUs busy: other above is the same during each run")
    write_results("notebooks-generate-speed", {"rounds": rounds, "new_tokens": NEW_TOKENS,
                                               "load_before": load_before, "load_after": load_after,
                                               "samples": {f"{n} | {w}": c for (n, w), c in found.items()}})


def main() -> None:
    global NEW_TOKENS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="notebooks to time (default: all)")
    parser.add_argument("--generate-speed", action="store_true", help="tokens/s by place, interleaved (see above)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    args = parser.parse_args()
    if args.generate_speed:
        NEW_TOKENS = args.new_tokens
        return generate_speed(args.rounds)
    notebook_wall_times(args.names or sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")))


if __name__ == "__main__":
    main()
