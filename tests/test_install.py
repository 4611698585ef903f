"""The project as a user installs it without a checkout: build a wheel, install it (not
editable) into a fresh environment, and run a kernel, `workbench generate` and the magics
from there. The C++ sources travel as package data and compile in the new place."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

import pytest

import background

ROOT = Path(__file__).resolve().parents[1]


def prepare_in_background():
    """Build a wheel from a copy of the tree, install it into a fresh environment and let the
    installed package compile its kernels there, the way a user's first import does.
    Started at nice 19 when the suite is collected (tests/background.py): this is a minute of
    compiling that needs nothing from the other tests. Returns (wheel, python, env, folder)."""
    tmp = background.remove_at_exit(Path(tempfile.mkdtemp(prefix="workbench-install-")))
    # Built from a copy of the source tree: a setuptools build leaves build/ behind, and a stale
    # one in the checkout broke a later build here.
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "results", ".cache", "*.egg-info",
                                                             "__pycache__", ".hypothesis", ".pytest_cache"))
    background.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", src])
    wheel = next((tmp / "dist").glob("cpu_llm_workbench-*.whl"))
    env_dir = tmp / "venv"
    background.run([sys.executable, "-m", "venv", "--without-pip", env_dir])
    python = env_dir / "bin" / "python"
    background.run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel])
    # The dependencies (torch, gguf, ...) come from this environment's site-packages as a plain
    # path: its .pth files, the editable install's among them, are not processed from there.
    site = Path(background.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {"PATH": f"{env_dir / 'bin'}:/usr/bin:/bin", "HOME": str(tmp), "WORKBENCH_CACHE_DIR": str(tmp / "cache")}
    # The installed package's first use compiles its kernels from the sources it ships.
    background.run([python, "-c", "import workbench.kernels as K; K.native.ext"], env=env, cwd=tmp)
    return wheel, python, env, tmp


def run(cmd, **kw):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{cmd} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r


@pytest.fixture(scope="module")
def installed():
    return background.result(prepare_in_background)


def test_wheel_ships_the_sources_inside_the_package(installed):
    wheel = installed[0]
    names = zipfile.ZipFile(wheel).namelist()
    for source in (ROOT / "kernels").iterdir():
        assert f"workbench/kernels/csrc/{source.name}" in names, source.name
    assert "workbench/magics/__init__.py" in names
    assert not [n for n in names if n.startswith(("magics/", "kernels/"))]  # nothing generic at the top
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "workbench").rglob("__init__.py")}
    assert packages <= {str(Path(n).parent) for n in names}, "a package missing from pyproject.toml"


def test_installed_package_runs_a_kernel_generate_and_the_magics(installed):
    _, python, env, tmp = installed
    code = ("import torch, workbench, workbench.kernels as K; "
            "assert 'site-packages' in workbench.__file__, workbench.__file__; "
            "import importlib.util; assert importlib.util.find_spec('magics') is None; "
            "q = torch.randn(1, 4, 33, 16); k = torch.randn(1, 2, 33, 16); "
            "ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), "
            "k.repeat_interleave(2, 1), is_causal=True); "
            "torch.testing.assert_close(K.slim_attention(q, k, k), ref, atol=1e-4, rtol=1e-4); "
            "print(K.build_info()['sources'][0])")
    r = run([python, "-c", code], env=env, cwd=tmp)
    assert "site-packages/workbench/kernels/csrc/" in r.stdout
    assert list((tmp / "cache" / "kernels").glob("native-*/workbench_kernels_native*.so")), "compiled elsewhere"
    r = run([tmp / "venv" / "bin" / "workbench", "generate", "The capital of France is", "--max-new-tokens", "6"],
            env=env, cwd=tmp)
    assert "Paris" in r.stdout and "tokens/s" in r.stdout
    magic = ("from IPython.core.interactiveshell import InteractiveShell; sh = InteractiveShell.instance(); "
             "sh.run_line_magic('load_ext', 'workbench'); sh.run_line_magic('load_model', 'smollm2-135m'); "
             "sh.run_line_magic('generate', '-n 4 The capital of France is')")
    r = run([python, "-c", magic], env=env, cwd=tmp)
    assert "Paris" in r.stdout
