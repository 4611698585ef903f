"""Building the C++ kernels in `kernels/` as a torch extension, on first use.

The extension is compiled for the host (`-O3 -march=native`) through
`torch.utils.cpp_extension.load`, which caches the build and rebuilds when a source
or a flag changes. Variants exist so the tests can run every instruction-set path the
host can execute:

    native   -march=native            (AVX-512 on hosts that have it, else AVX2, ...)
    avx2     -march=native -mno-avx512f  (the AVX2 path on an AVX-512 host)
    scalar   -march=x86-64            (the portable fallback)
    emulated -march=x86-64-v3 with kernels/emulate_isa.h forced in: the AVX-512 path, with
             the AVX-512, VNNI, AVX512-BF16 and AMX instructions it runs as plain C++, so
             tests run the code of an AMX host on any AVX2 CPU (correctness only; a test
             build, never a user's)

Builds live under $WORKBENCH_CACHE_DIR (default ~/.cache/workbench)/kernels, one folder
per variant and CPU, so a home directory shared by different machines stays correct.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path
from types import ModuleType

from workbench.cache import KERNELS_BUILD_ENV, cache_dir, cpu_key
from workbench.hw.machine import machine_info



def _source_dir() -> Path:
    """The C++ sources: shipped inside the package as workbench/kernels/csrc (a wheel or a
    plain `pip install .` maps the repository's top-level kernels/ folder there, see
    pyproject.toml), or the checkout's kernels/ folder itself (an editable install)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "csrc", here.parents[1] / "kernels"):
        if (candidate / "bindings.cpp").is_file():
            return candidate
    return here / "csrc"  # neither exists: _check_toolchain names this folder in its error


SOURCE_DIR = _source_dir()
SOURCES = ("bindings.cpp", "ops.cpp", "prefill_attention.cpp", "decode_attention.cpp", "decode_tiled.cpp", "decode_step.cpp", "kv_cache.cpp", "linear.cpp",
           "rope.cpp", "peaks.cpp", "shm_comm.cpp", "gemm_bf16.cpp", "prefill_tiles.cpp",
           "random.cpp", "blocks.cpp")
# GCC 12's AVX-512 headers trip -W(maybe-)uninitialized inside the intrinsics themselves
# (_mm512_castps512_ps256 and friends use a self-initialised temporary); fixed in GCC 13.
# -fopenmp: at::parallel_for is an inline OpenMP loop in torch's headers; without the flag
# it silently runs on one thread. The process already has torch's libgomp loaded.
# -g1: symbols and line numbers, so a profiler (%profile --native, py-spy) names our kernels,
# without -g's descriptions of local variables, which a profiler never reads and which cost
# the bindings a third of their compile time; it changes no generated code.
BASE_FLAGS = ("-O3", "-g1", "-fopenmp", "-Wall", "-Wno-unused-function", "-Wno-uninitialized",
              "-Wno-maybe-uninitialized")

_X86 = platform.machine() in ("x86_64", "AMD64", "i686")
VARIANT_FLAGS: dict[str, tuple[str, ...]] = {
    "native": ("-march=native",) if _X86 else ("-mcpu=native",),
    # the AVX2 hosts we target (Zen 3) have no AVX-VNNI either: its int8 path is pmaddubsw
    "avx2": ("-march=native", "-mno-avx512f", "-mno-avxvnni"),
    "scalar": ("-march=x86-64", "-mtune=generic") if _X86 else (),
    # -Wno-psabi: the emulations pass 64-byte vectors by value outside AVX-512 code, a
    # calling convention GCC warns about; they are all inline in one build. -O2: with every
    # vector operation an inlined C++ loop, -O3 compiles far longer for a modestly faster
    # run, -O1 compiles a little faster for a far slower one (docs/runtime-and-kernels.md)
    "emulated": ("-march=x86-64-v3", "-mtune=generic", "-O2", "-DWBK_EMULATE_ISA", "-Wno-psabi",
                 "-include", str(SOURCE_DIR / "emulate_isa.h")),
}


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be built (no compiler, no ninja, or a compile error)."""


def compiler() -> str:
    return os.environ.get("CXX", "c++")


def compiler_version() -> str:
    exe = shutil.which(compiler())
    if exe is None:
        return "not found"
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False).stdout
    return out.splitlines()[0] if out else exe


def runnable_variants() -> list[str]:
    """The distinct variants whose instructions this host can execute. "avx2" only where it
    differs from "native", that is where the host has one of the extensions it turns off; on
    an AVX2-only host the two would be the same build."""
    info = machine_info()
    variants = ["native"]
    if _X86 and info.has_avx2 and info.flags & {"avx512f", "avx_vnni"}:
        variants.append("avx2")
    if _X86:
        variants.append("scalar")
    return variants


def process_build() -> str:
    """The build the whole workbench runs on in this process (the module-level kernels, every
    model): native, unless $WORKBENCH_KERNELS_BUILD names another variant, to run a model
    end to end on the avx2 or scalar path, or on "emulated" (an AMX host's AVX-512 path and
    bf16 engines on a CPU without them: correct, and far slower)."""
    build = os.environ.get(KERNELS_BUILD_ENV, "native")
    if build not in VARIANT_FLAGS:
        raise ValueError(f"{KERNELS_BUILD_ENV} must be one of {', '.join(VARIANT_FLAGS)}, got {build!r}")
    return build


def emulation_runs_here() -> bool:
    """Whether this host can run the "emulated" build (x86-64-v3: AVX2, FMA, F16C, BMI2, ...)."""
    info = machine_info()
    return _X86 and info.has_avx2 and {"fma", "f16c", "bmi2", "movbe"} <= set(info.flags)


def variant_isa(variant: str) -> str:
    """The code path (kernels/simd.h: "avx512", "avx2" or "scalar") the `variant` build
    compiles on this host, which its module's isa() must report."""
    info = machine_info()
    if variant == "emulated":  # the AVX-512 path, its instructions written out in C++
        return "avx512"
    if not _X86 or variant == "scalar" or not info.has_avx2:
        return "scalar"
    return "avx512" if variant == "native" and info.has_avx512 else "avx2"


def _sources_key(variant: str) -> str:
    """A hash of every C++ source and header, where they are, the flags and torch's version:
    a build folder holds one build of one set of sources, so a changed source never meets an
    old object or an old module (torch's own check misses a source added to the list). The
    folder the sources are in counts too: ninja's commands name them by path, so two
    checkouts sharing one cache (a second clone, an environment activated from another)
    would each find the other's commands in the folder and recompile everything in turn."""
    import torch

    h = hashlib.sha1(f"{torch.__version__}|{BASE_FLAGS}|{VARIANT_FLAGS[variant]}|{SOURCES}|{SOURCE_DIR}".encode())
    for path in sorted(SOURCE_DIR.glob("*")):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:10]


def _build_dir(variant: str, sources_key: str | None = None) -> Path:
    # Keyed by the CPU as well: -march=native code from another machine may not run here.
    return cache_dir() / "kernels" / f"{variant}-{cpu_key()}-{sources_key or _sources_key(variant)}"


@contextlib.contextmanager
def our_ninja():
    """PATH with the `ninja` installed beside this Python (the `ninja` package, a dependency)
    first, while torch builds. Another ninja on PATH (a distribution's, found by a process
    started without the environment activated, such as an engine started over ssh) keeps its
    build log in another format version: each reads the other's log as invalid and recompiles
    every source, so two such processes sharing one build folder rebuilt it in turn (a full
    compile at every start of one or the other)."""
    try:
        import ninja

        bin_dir = ninja.BIN_DIR
    except (ImportError, AttributeError):
        yield  # not installed: whichever ninja PATH finds (_check_toolchain says if none)
        return
    before = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([bin_dir, before]) if before else bin_dir
    try:
        yield
    finally:
        os.environ["PATH"] = before


def _check_toolchain() -> None:
    if shutil.which(compiler()) is None:
        raise KernelBuildError(
            f"no C++ compiler found (looked for {compiler()!r} on PATH; set CXX to choose another). "
            "The kernels are compiled on first use: install g++ (Debian/Ubuntu: apt-get install g++)."
        )
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        raise KernelBuildError("the ninja build tool is missing: pip install ninja")
    missing = [s for s in SOURCES if not (SOURCE_DIR / s).is_file()]
    if missing:
        raise KernelBuildError(
            f"kernel sources {missing} not found in {SOURCE_DIR}; the installed package is incomplete: "
            "reinstall it (`pip install .` from the source tree, or the wheel)"
        )


_lock = threading.Lock()
_modules: dict[str, ModuleType] = {}


@contextlib.contextmanager
def build_claim(build_dir: Path):
    """Hold an flock on the build folder while torch compiles or loads into it. torch's own
    lock is a plain file that a killed build leaves behind, and the next load then waits on it
    forever; the flock is released by the kernel when its holder dies, so whoever holds it
    knows that lock file is stale and removes it."""
    with open(build_dir / "workbench.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # waits while another live process builds here
        (build_dir / "lock").unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_extension(variant: str = "native", verbose: bool = False) -> ModuleType:
    """Compile (if needed) and import the extension for `variant`."""
    if variant not in VARIANT_FLAGS:
        raise ValueError(f"variant must be one of {sorted(VARIANT_FLAGS)}, got {variant!r}")
    with _lock:
        if variant in _modules:
            return _modules[variant]
        from torch.utils.cpp_extension import load

        with our_ninja():
            _check_toolchain()
            sources_key = _sources_key(variant)  # reads every source once: the build folder and the crossover's cache
            build_dir = _build_dir(variant, sources_key)
            build_dir.mkdir(parents=True, exist_ok=True)
            try:
                with build_claim(build_dir):
                    module = load(
                        name=f"workbench_kernels_{variant}",
                        sources=[str(SOURCE_DIR / s) for s in SOURCES],
                        extra_cflags=[*BASE_FLAGS, *VARIANT_FLAGS[variant]],
                        extra_ldflags=["-fopenmp"],
                        build_directory=str(build_dir),
                        verbose=verbose,
                    )
            except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
                raise KernelBuildError(
                    f"building the {variant!r} kernels in {build_dir} failed: {e}. "
                    f"Run `python -m workbench.kernels --info --verbose` to see the compiler output."
                ) from e
        from workbench.kernels import crossover, prefetch

        prefetch.apply(module, measure_if_missing=variant == "native")  # measured for this host, once
        crossover.apply(module, sources_key, measure_if_missing=variant == "native")
        _modules[variant] = module
        return module


def build_info(variant: str | None = None) -> dict:
    """What was built: ISA path, compiler, flags, micro-kernel tile, where it lives (the
    process's build unless `variant` names another)."""
    variant = variant or process_build()
    module = load_extension(variant)
    return {
        "variant": variant,
        "isa": module.isa(),
        "compiler": compiler_version(),
        "flags": [*BASE_FLAGS, *VARIANT_FLAGS[variant]],
        "gemm_tile": f"{module.gemm_mr()} x {module.gemm_nr()}",
        "int8_dot": module.decode_dot_isa(),
        # the GEMM (batched decode, prefill) per weight kernel: fp32 on the FMA micro-kernel,
        # bf16 and int8 on the engine in force; and why the matrix engine may or may not run
        "gemm_engine": {k: module.gemm_engine_for(k) for k in module.constants()["weight_kernels"]},
        # up to how many rows each weight kernel runs the matrix-vector kernel (measured here)
        "matvec_max_rows": {k: module.matvec_max_rows(k) for k in module.constants()["weight_kernels"]},
        # the block-quantized weights' integer dot products (kernels/blocks.cpp)
        "block_dot": module.block_dot_isa(),
        # prefill attention per input dtype: bf16 q / k / v on the same engine (prefill_tiles.cpp)
        "prefill_attention": {"float32": "fma", "bfloat16": module.gemm_engine_for("bfloat16")},
        "amx_bf16": module.gemm_engines()["amx_bf16"][1],
        "amx_int8": module.gemm_engines()["amx_int8"][1],
        "prefetch": dict(zip(("bytes", "hint", "pipeline"), module.get_prefetch())),
        "matvec_prefetch": {name: dict(zip(("bytes", "hint", "max_chunk_bytes", "serial_max_chunk_bytes"),
                                           module.get_matvec_prefetch(name)))
                            for name in ("float32", "bfloat16", "int8")},
        "build_dir": str(_build_dir(variant)),
        "sources": [str(SOURCE_DIR / s) for s in SOURCES],
    }
