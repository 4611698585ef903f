#!/usr/bin/env python3
"""Strip a notebook's outputs, execution counts and widget state: reads a notebook on
stdin, writes it on stdout. It is the repository's git "clean" filter for *.ipynb
(.gitattributes; scripts/bootstrap registers it), so running a notebook in JupyterLab,
which autosaves its outputs, never shows up as a change to commit.

    python3 scripts/strip_notebook_outputs.py < in.ipynb > out.ipynb
    python3 scripts/strip_notebook_outputs.py notebooks/*.ipynb     # in place

The filter alone leaves `git status` listing a run notebook: git keeps each file's size in
its index and, when the size on disk differs, calls the file modified without running the
filter (`git diff` does run it, finds nothing, and leaves the index as it was). post_save
is JupyterLab's answer: scripts/setup-notebook-git (which scripts/bootstrap runs) installs
it as the environment's JupyterLab server's post-save hook
(.venv/etc/jupyter/jupyter_server_config.py), and after every save of a tracked notebook
whose filtered content git finds unchanged it `git add`s it, which stores the same content
and the new size. A notebook whose code changed is left alone. Without JupyterLab (another
editor), `git add notebooks/` does the same by hand.
"""

import json
import os
import subprocess
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


def post_save(model=None, os_path: str = "", contents_manager=None, **_) -> None:
    """jupyter_server's post-save hook (see the module docstring): after a notebook is saved,
    record its new size in git's index if git sees no change in it, filtered."""
    if not os_path.endswith(".ipynb"):
        return
    folder, name = os.path.split(os.path.abspath(os_path))

    def git(*args) -> int:
        return subprocess.run(["git", "-C", folder, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode

    if git("ls-files", "--error-unmatch", "--", name) != 0:  # not in a repository, or not tracked: not ours to add
        return
    if git("diff", "--quiet", "--", name) == 0:  # only what the filter strips has changed
        git("add", "--", name)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        for path in sys.argv[1:]:
            with open(path, encoding="utf-8") as f:
                text = dumps(strip(json.load(f)))
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
    else:
        sys.stdout.write(dumps(strip(json.load(sys.stdin))))
