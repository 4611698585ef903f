"""Wall time of each notebook executed top to bottom by a real kernel, at its own
(full-size) parameters: the quickstart should run in under 3 minutes.

    python bench/notebooks.py [names...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_table, write_results  # noqa: E402
import nbclient  # noqa: E402
import nbformat  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def main() -> None:
    names = sys.argv[1:] or sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
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


if __name__ == "__main__":
    main()
