"""The kernels' build: what --info reports, every ISA path compiles, a missing compiler
gives a clear error instead of a traceback from deep inside torch."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch.utils.cpp_extension as cpp

from workbench.kernels._build import SOURCE_DIR, SOURCES, runnable_variants, variant_isa

KERNEL_UNITS = [s for s in SOURCES if s not in ("bindings.cpp", "ops.cpp")]  # those two: no ISA-specific code
ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"],  # as every AVX-512 CPU has
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "scalar": ["-march=x86-64"],
}
ISA_MACRO = {"avx512": "WBK_ISA_AVX512", "avx2": "WBK_ISA_AVX2", "scalar": "WBK_ISA_SCALAR"}


def compile_unit(path, out, flags):
    # -O0 unless the flags say otherwise: an intrinsic outside its target is still an error
    # (GCC inlines always_inline functions at every level), in half the time of -O2
    cmd = ["c++", "-std=c++17", "-O0", "-fopenmp", "-c", str(path), "-o", str(out), *flags]
    cmd += [f"-I{p}" for p in cpp.include_paths()]
    return subprocess.run(cmd, capture_output=True, text=True)


def test_each_build_runs_its_isa_path(kernels):
    """Every build this host runs (the `kernels` fixture's: native, avx2 where it differs,
    scalar) selected the code path its flags promise; the kernel tests then run on it."""
    assert kernels.ext.isa() == variant_isa(kernels.variant)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
def test_every_isa_path_compiles(tmp_path, isa):
    """Each kernel translation unit compiles for the ISA, and selects that ISA's code path:
    the AVX-512 build uses zmm registers, the others do not. Compiled here for the ISAs this
    host has no build of (AVX-512 even on hosts that cannot run it); the others are built
    with -O3 and run by the kernel tests (test_each_build_runs_its_isa_path)."""
    built = {variant_isa(v): v for v in runnable_variants()}
    if isa in built:
        pytest.skip(f"compiled, run and tested here as the {built[isa]!r} build")
    probe = tmp_path / "probe.cpp"
    probe.write_text(f'#include "simd.h"\n#ifndef {ISA_MACRO[isa]}\n#error "wrong ISA path"\n#endif\n')
    units = [probe] + [SOURCE_DIR / u for u in KERNEL_UNITS]
    flags = ISA_FLAGS[isa] + [f"-I{SOURCE_DIR}"]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda u: compile_unit(u, tmp_path / (u.stem + ".o"), flags), units))
    for unit, r in zip(units, results):
        assert r.returncode == 0, f"{unit.name} failed to compile for {isa}:\n{r.stderr[-3000:]}"
    asm = subprocess.run(["objdump", "-d", str(tmp_path / "decode_attention.o")], capture_output=True,
                         text=True).stdout
    assert ("zmm" in asm) == (isa == "avx512")
    if isa == "avx2":
        assert "ymm" in asm


def test_info_reports_the_build():
    r = subprocess.run([sys.executable, "-m", "workbench.kernels", "--info", "--json"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    import json

    info = json.loads(r.stdout)
    assert info["isa"] in ("avx512", "avx2", "scalar")
    assert "-march=native" in info["flags"] and "-O3" in info["flags"]
    assert "L2" in " ".join(info["caches"]) and info["threads"] >= 1
    assert info["compiler"] != "not found"


def test_missing_compiler_is_a_clear_error(tmp_path):
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), WORKBENCH_CACHE_DIR=str(tmp_path / "cache"))
    code = "import torch, workbench.kernels as K; K.slim_attention(*(torch.randn(1, 1, 4, 8),) * 3)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode != 0
    assert "KernelBuildError: no C++ compiler found" in r.stderr
    assert "no-such-compiler" in r.stderr


def test_an_unknown_process_build_is_a_clear_error():
    """$WORKBENCH_KERNELS_BUILD picks the build a whole process runs; a name that is not one
    is refused by name at import, not by a missing folder later."""
    env = dict(os.environ, WORKBENCH_KERNELS_BUILD="avx1024")
    r = subprocess.run([sys.executable, "-c", "import workbench.kernels"], capture_output=True, text=True, env=env)
    assert r.returncode != 0
    assert ("ValueError: WORKBENCH_KERNELS_BUILD must be one of native, avx2, scalar, emulated, got 'avx1024'"
            in r.stderr), r.stderr[-2000:]


def test_processes_with_and_without_the_environment_on_path_share_one_build():
    """A notebook's shell has the environment activated; an engine started over ssh, or CI's
    `.venv/bin/python -m pytest`, has not. Each finds a different `ninja` on PATH if the system
    has one, and two ninja versions discard each other's build log: every load rebuilt every
    source. Loads from both kinds of process must leave the objects as they are."""
    from workbench.kernels._build import _build_dir

    code = "from workbench.kernels import native; native.ext"
    activated = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), "/usr/bin", "/bin"]))
    bare = dict(os.environ, PATH="/usr/bin:/bin")
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=activated)
    assert first.returncode == 0, first.stderr[-2000:]
    objects = sorted(_build_dir("native").glob("*.o"))
    assert objects
    built = {o.name: o.stat().st_mtime_ns for o in objects}
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=bare)
    assert again.returncode == 0, again.stderr[-2000:]
    assert {o.name: o.stat().st_mtime_ns for o in objects} == built


def test_two_checkouts_sharing_a_cache_build_in_two_folders(tmp_path, monkeypatch):
    """ninja's commands name the sources by path: a second checkout (or a shell whose
    activated environment imports another one's workbench) with the same sources, built
    into the same folder, rewrote the commands and recompiled everything at each switch.
    Each folder of sources gets its own build folder; the same folder keeps its own."""
    import shutil

    from workbench.kernels import _build

    here = _build._sources_key("native")
    copy = tmp_path / "kernels"
    shutil.copytree(_build.SOURCE_DIR, copy)
    monkeypatch.setattr(_build, "SOURCE_DIR", copy)
    assert _build._sources_key("native") != here
    monkeypatch.undo()
    assert _build._sources_key("native") == here


def test_the_streaming_kernels_really_prefetch():
    """The per-host prefetch choice only matters if the instructions exist: GCC 12 once
    dropped every __builtin_prefetch of a switch over the hint, silently. Each streaming
    unit of the extension this host runs (its own objects, as they were compiled) must
    contain all four prefetch instructions."""
    import shutil

    from workbench.kernels._build import build_info

    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed")
    build_dir = Path(build_info("native")["build_dir"])  # built (or loaded) by the session already
    for unit in ("decode_tiled", "decode_attention", "linear"):
        obj = build_dir / f"{unit}.o"
        assert obj.is_file(), f"the native build has no {obj.name}"
        asm = subprocess.run(["objdump", "-d", str(obj)], capture_output=True, text=True).stdout
        for insn in ("prefetcht0", "prefetcht1", "prefetcht2", "prefetchnta"):
            assert insn in asm, f"{unit}: no {insn} in the object code"
