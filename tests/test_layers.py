"""The package's layers are true: no module imports one from a higher floor, at the top of
the file or deferred inside a function (a deferred import hides a cycle, it does not remove
it). The order is the one workbench/__init__.py and README's Layout state."""

from __future__ import annotations

import ast
import re
import shutil
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]

# Bottom up; names on one floor may import each other.
LAYERS = [("cache", "hw"), ("kernels",), ("model",), ("runtime",), ("distributed", "serving"), ("analysis",), ("ui",),
          ("report",), ("options", "magics"), ("cli",)]
FLOOR = {name: i for i, names in enumerate(LAYERS) for name in names}


def _package_files(package: Path, magics: Path):
    for path in sorted(package.rglob("*.py")):
        yield ".".join(path.relative_to(package.parent).with_suffix("").parts), path
    for path in sorted(magics.rglob("*.py")):  # installed as workbench.magics
        yield "workbench.magics." + ".".join(path.relative_to(magics).with_suffix("").parts), path


def _top(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "workbench" and len(parts) > 1 else None


def violations(package: Path, magics: Path) -> list[str]:
    """'importer -> imported (line n)' for every import of a higher floor."""
    found = []
    for module, path in _package_files(package, magics):
        me = _top(module)
        if me in (None, "__init__"):
            continue  # the package's own __init__ re-exports every floor, lazily
        if me not in FLOOR:
            found.append(f"{module}: not on any floor of tests/test_layers.py's LAYERS")
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
                if node.module == "workbench":
                    names = [f"workbench.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                other = _top(name)
                if other is None or other == me or other not in FLOOR:
                    continue
                if FLOOR[other] > FLOOR[me]:
                    found.append(f"{module} -> {name} (line {node.lineno})")
    return found


def test_no_module_imports_a_higher_floor():
    assert violations(ROOT / "workbench", ROOT / "magics") == []


def test_the_check_catches_a_bad_import(tmp_path):
    """A deliberate violation in a scratch copy (the model layer importing the report layer,
    deferred inside a function) is found and named."""
    shutil.copytree(ROOT / "workbench", tmp_path / "workbench")
    shutil.copytree(ROOT / "magics", tmp_path / "magics")
    config = tmp_path / "workbench" / "model" / "config.py"
    config.write_text(config.read_text() + "\n\ndef _bad():\n    from workbench.report import record\n")
    found = violations(tmp_path / "workbench", tmp_path / "magics")
    assert len(found) == 1 and found[0].startswith("workbench.model.config -> workbench.report"), found


def test_every_package_folder_is_on_a_floor():
    folders = {p.name for p in (ROOT / "workbench").iterdir() if p.is_dir() and p.name != "__pycache__"}
    modules = {p.stem for p in (ROOT / "workbench").glob("*.py") if p.stem != "__init__"}
    assert folders | modules | {"magics"} <= set(FLOOR), (folders | modules) - set(FLOOR)


def test_the_machine_layer_imports_alone():
    """`import workbench.hw` loads neither torch nor the model, kernels or report layers."""
    import subprocess

    code = "import sys, workbench.hw; print(sorted(m for m in sys.modules if m.startswith(('workbench', 'torch'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = set(ast.literal_eval(out))
    assert loaded == {"workbench", "workbench.hw", "workbench.hw.machine"}, loaded


def test_readme_layout_states_the_order():
    """README's Layout lists the floors in the same order as LAYERS."""
    text = (ROOT / "README.md").read_text()
    layout = text[text.index("## Layout"):]
    order = [m.group(1) for m in re.finditer(r"^  (\w+)[/.]", layout, re.M)]
    floors = [FLOOR[name] for name in order if name in FLOOR]
    assert floors == sorted(floors), order
