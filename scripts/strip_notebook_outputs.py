#!/usr/bin/env python3
"""Strip a notebook's outputs, execution counts and widget state: reads a notebook on
stdin, writes it on stdout. It is the repository's git "clean" filter for *.ipynb
(.gitattributes; scripts/bootstrap registers it), so running a notebook in JupyterLab,
which autosaves its outputs, never shows up as a change to commit.

    python3 scripts/strip_notebook_outputs.py < in.ipynb > out.ipynb
    python3 scripts/strip_notebook_outputs.py notebooks/*.ipynb     # in place
"""

import json
import sys


# The notebook metadata every stored notebook has, whatever kernel ran it: JupyterLab rewrites
# the kernelspec's display name and adds language_info (with the running Python's version)
# when it saves, which must not show as a change either.
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
LANGUAGE_INFO = {"name": "python"}


def strip(nb: dict) -> dict:
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        cell.get("metadata", {}).pop("execution", None)
    meta = nb.setdefault("metadata", {})
    meta.pop("widgets", None)
    meta["kernelspec"] = dict(KERNELSPEC)
    meta["language_info"] = dict(LANGUAGE_INFO)
    return nb


def dumps(nb: dict) -> str:
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"  # as nbformat writes


if __name__ == "__main__":
    if len(sys.argv) > 1:
        for path in sys.argv[1:]:
            with open(path, encoding="utf-8") as f:
                text = dumps(strip(json.load(f)))
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
    else:
        sys.stdout.write(dumps(strip(json.load(sys.stdin))))
