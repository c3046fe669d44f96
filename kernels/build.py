"""Builds the kernel library on first use, and loads it.

    python -m kernels.build            # what `make kernels` runs: build (if needed) and report
    python -m kernels.build --verbose  # and show the compiler's commands and output
    python -m kernels.build --werror   # what `make test` builds with: a warning fails the build
    python -m kernels.build --werror-checked   # did the build in place compile with --werror?

torch.utils.cpp_extension compiles csrc/ into a Python module with the host C++ compiler (and
nvcc for csrc/cuda/ when torch is a CUDA build), through ninja, into kernels/build/ (or
KERNELS_BUILD_DIR), and stamps the folder with a fingerprint of every source byte and flag. A
later load whose sources have that fingerprint imports the built module directly, without the
compiler or ninja: a fraction of a second, also for a copy of kernels/ pointed at this build. Any
changed byte rebuilds, the sources whose bytes changed from scratch (ninja goes by modification
times, which a restored file may have older than its object). Two processes building at once wait
for each other (a lock the kernel releases when its holder dies, however it dies), and the second
imports what the first built, or fails as it did.

The CPU half is compiled for any x86-64 (no -march=native: the module must run on the machine
that did not build it, e.g. a cluster's other nodes); its AVX2 and AVX512 paths are chosen at
run time (csrc/cpu/isa.cpp). OpenMP: the module links libgomp.so.1, and since torch has already
loaded its own copy under that name, both share one thread pool. Two OpenMP runtimes would each
keep threads spinning, and on two cores that costs 10x.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
STAMP = "sources.sha256"  # beside the built module: the fingerprint() it was built from
# Beside it when the build compiled every C++ source with WARNINGS, which change no code: the same
# fingerprint. `make test` builds so, and its C++ check (csrc/cpu/check_compile.sh, the same flags,
# some 70 s of CPU on two cores) then has nothing left to compile.
WERROR_STAMP = "werror.sha256"
OBJECTS = "objects.json"  # each source's sha256 when its object was compiled (see _drop_stale_objects)
WARNINGS = ["-Wall", "-Wextra", "-Werror"]


class KernelBuildError(RuntimeError):
    """The kernels could not be built here; the message says why and what to do."""


def cuda_build_possible() -> str | None:
    """None when the CUDA half can be built, else why not."""
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None or not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return "nvcc was not found (set CUDA_HOME to the CUDA toolkit)"
    return None


# What torch's own extension builds pass nvcc: keep half and bfloat16 conversions explicit (the
# kernels convert through dtype.cuh), so this build compiles what check_compile.sh checks.
TORCH_NVCC_DEFINES = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
]
# Where no GPU is visible (a login node) and TORCH_CUDA_ARCH_LIST is unset: A100 and H100 machine
# code, and H100 PTX, which newer GPUs compile on first launch.
DEFAULT_ARCHS = "8.0;9.0+PTX"


def cuda_archs() -> list[tuple[int, int, bool]]:
    """(major, minor, with PTX) for each architecture to build: TORCH_CUDA_ARCH_LIST when set
    ("7.5;8.6+PTX", spaces or semicolons), else every visible GPU's, else DEFAULT_ARCHS."""
    spec = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if not spec:
        import torch

        if torch.cuda.is_available():
            caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
            spec = ";".join(f"{major}.{minor}" for major, minor in caps)
        else:
            spec = DEFAULT_ARCHS
    archs = []
    for item in spec.replace(" ", ";").split(";"):
        if not item:
            continue
        number, ptx = item.removesuffix("+PTX"), item.endswith("+PTX")
        # "9.0a" (sm_90a) and "10.0f" name arch-specific and family feature sets; these kernels use
        # none of them, so the plain architecture's code is what runs there.
        number = number.rstrip("af")
        try:
            major, minor = (int(part) for part in number.split("."))
        except ValueError:
            raise KernelBuildError(
                f"TORCH_CUDA_ARCH_LIST: {item!r} is not an architecture like 8.0 or 9.0+PTX"
            ) from None
        archs.append((major, minor, ptx))
    return archs


def gencode_flags(archs: list[tuple[int, int, bool]]) -> list[str]:
    flags = []
    for major, minor, ptx in archs:
        flags.append(f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{major}{minor},code=compute_{major}{minor}")
    return flags


def runs_on(capability: tuple[int, int], archs: list[tuple[int, int, bool]]) -> bool:
    """Whether a build for `archs` has code for a GPU of `capability`: machine code for the same
    major version and an equal or lower minor one, or PTX of an equal or lower version."""
    return any(
        (major == capability[0] and minor <= capability[1]) or (ptx and (major, minor) <= capability)
        for major, minor, ptx in archs
    )


def gpu_not_covered(module, device) -> str | None:
    """Why `module`'s CUDA code cannot run on the GPU `device`, or None when it can."""
    import torch

    capability = torch.cuda.get_device_capability(device)
    if runs_on(capability, module.cuda_archs):
        return None
    built = ", ".join(f"sm_{major}{minor}" + (" +PTX" if ptx else "") for major, minor, ptx in module.cuda_archs)
    return (
        f"kernels/ was built for {built}, not this GPU's sm_{capability[0]}{capability[1]}: "
        f'rebuild with TORCH_CUDA_ARCH_LIST="{capability[0]}.{capability[1]}" (rm -rf kernels/build; make kernels)'
    )


def sources(with_cuda: bool) -> list[Path]:
    files = [*sorted(CSRC.glob("*.cpp")), *sorted((CSRC / "cpu").glob("*.cpp"))]  # torch glue, CPU half
    return files + (sorted((CSRC / "cuda").glob("*.cu")) if with_cuda else [])


def _variant(with_cuda: bool) -> str:
    """One build folder per torch and Python: a module built against one does not load in another."""
    import torch

    flavour = f"cu{torch.version.cuda.replace('.', '')}" if with_cuda else "cpu"
    return f"torch{torch.__version__.split('+')[0]}-{flavour}-py{sys.version_info.major}{sys.version_info.minor}"


def build_root() -> Path:
    """kernels/build/, or KERNELS_BUILD_DIR: a copy of kernels/ pointed at another build reuses it
    when its sources are the same bytes."""
    return Path(os.environ.get("KERNELS_BUILD_DIR") or HERE / "build")  # (set but empty: the default)


def build_dir(with_cuda: bool) -> Path:
    return build_root() / _variant(with_cuda)


def _check_tools() -> None:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise KernelBuildError(
            f"no C++ compiler: `{compiler}` is not on PATH. Install one (Debian/Ubuntu: "
            "`apt install g++`; or set CXX), then run `make kernels`."
        )
    if shutil.which("ninja") is None:
        try:
            import ninja  # the pip package carries a ninja binary: beside python, or in its own folder
        except ImportError:
            raise KernelBuildError("ninja is missing: `pip install ninja` (it is in requirements.txt)") from None
        bin_dirs = [getattr(ninja, "BIN_DIR", ""), str(Path(sys.executable).parent)]  # BIN_DIR: a --user install's
        os.environ["PATH"] = os.pathsep.join([d for d in bin_dirs if d] + [os.environ["PATH"]])
        if shutil.which("ninja") is None:
            raise KernelBuildError(
                f"ninja's Python package is installed ({ninja.__file__}) but its ninja program is on no PATH: "
                "put the folder pip installed it into on PATH"
            )


def fingerprint(files: list[Path], *flags: list[str]) -> str:
    """What a build is made of: every source and header, byte for byte, and the flags. Bytes, not
    modification times: a checkout or a copy rewrites the times of files it does not change."""
    digest = hashlib.sha256()
    for path in sorted({*files, *_headers()}):
        digest.update(path.relative_to(CSRC).as_posix().encode() + b"\0" + path.read_bytes())
    digest.update(repr(flags).encode())
    return digest.hexdigest()


def _headers() -> list[Path]:
    """The library's headers (the emulator's, csrc/emulator, are not the library's)."""
    found = [*CSRC.rglob("*.h"), *CSRC.rglob("*.cuh")]
    return sorted(p for p in found if "emulator" not in p.relative_to(CSRC).parts)


def _stamped(path: Path, stamp: str) -> bool:
    return path.exists() and path.read_text() == stamp


def _import_built(name: str, folder: Path, stamp: str):
    """The module built from these exact sources, imported without the compiler or ninja (which
    would also rebuild a folder built from another copy's paths); None when there is none."""
    built = sorted(folder.glob(f"{name}*.so"))
    if not built or not _stamped(folder / STAMP, stamp):
        return None
    spec = importlib.util.spec_from_file_location(name, built[0])
    try:
        module = importlib.util.module_from_spec(spec)  # an extension module loads here
        spec.loader.exec_module(module)
    except (ImportError, OSError):  # stamped yet broken (a file damaged since): build it again
        return None
    return module


@contextmanager
def _folder_lock(folder: Path):
    """The build folder to ourselves: flock, which the kernel releases when its holder dies however
    it dies (cpp_extension's own lock file outlives a killed build and stalls the next forever)."""
    with open(folder / "build.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"kernels: waiting for another process building into {folder} ...", file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        (folder / "lock").unlink(missing_ok=True)  # cpp_extension's, left by a build that was killed
        yield


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _drop_stale_objects(folder: Path, files: list[Path]) -> dict:
    """Deletes the object of every source whose bytes changed since it was compiled (all of them
    when a header did): ninja compares modification times, and a file restored from a backup or a
    tarball can be older than its object while its bytes differ. -> the record to save once built."""
    now = {f.relative_to(CSRC).as_posix(): _sha256(f) for f in files}
    now["headers"] = fingerprint([])
    path = folder / OBJECTS
    try:
        before = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        before = {}
    for f in files:
        key = f.relative_to(CSRC).as_posix()
        if before.get("headers") != now["headers"] or before.get(key) != now[key]:
            for obj in (folder / f"{f.stem}.o", folder / f"{f.stem}.cuda.o"):
                obj.unlink(missing_ok=True)
    return now


class _Ticker:
    """One progress line while the compiler works: seconds so far, rewritten in place on a terminal."""

    def __init__(self, what: str):
        self.what, self.start, self.done = what, time.monotonic(), threading.Event()
        self.tty = sys.stderr.isatty()

    def __enter__(self):
        print(f"kernels: building {self.what} (first use: about a minute) ...", file=sys.stderr, flush=True)
        if self.tty:
            threading.Thread(target=self._tick, daemon=True).start()
        return self

    def _tick(self):
        while not self.done.wait(1.0):
            print(
                f"\rkernels: compiling ... {time.monotonic() - self.start:4.0f} s", end="", file=sys.stderr, flush=True
            )

    def __exit__(self, *exc):
        self.done.set()
        if self.tty:
            print(file=sys.stderr)
        if exc[0] is None:
            print(f"kernels: built in {time.monotonic() - self.start:.0f} s", file=sys.stderr, flush=True)


_module = None


def load(verbose: bool = False, werror: bool = False):
    """The compiled module (see csrc/bindings.cpp for its functions), built first if needed (werror:
    with WARNINGS, a warning failing the build). Where the CUDA half cannot be built, or fails to,
    the CPU half alone (with a message saying why)."""
    global _module
    if _module is not None:
        return _module
    import torch  # noqa: F401  first: its libgomp must be the one loaded (see above)

    if cuda_build_possible() is None:
        try:
            _module = _build(True, verbose, werror)
            return _module
        except KernelBuildError as e:
            print(f"kernels: the CUDA half failed to build; building the CPU half alone.\n{e}", file=sys.stderr)
    _module = _build(False, verbose, werror)
    return _module


class BuildPlan(NamedTuple):
    """What a build of one variant is made of, and the fingerprint() of it all."""

    name: str
    files: list[Path]
    folder: Path
    cflags: list[str]
    cuda_flags: list[str]
    archs: list[tuple[int, int, bool]]
    stamp: str


def _build_plan(with_cuda: bool) -> BuildPlan:
    files = sources(with_cuda)
    # No -std: torch's build picks the standard its headers need (C++17, C++20 for newer ATen).
    cflags = ["-O3", "-fopenmp"] + (["-DWITH_CUDA"] if with_cuda else [])
    archs = cuda_archs() if with_cuda else []
    cuda_flags = ["-O3", "-DWITH_CUDA", *TORCH_NVCC_DEFINES, *gencode_flags(archs)]
    name = "llm_kernels_cuda" if with_cuda else "llm_kernels_cpu"
    stamp = fingerprint(files, cflags, cuda_flags)
    return BuildPlan(name, files, build_dir(with_cuda), cflags, cuda_flags, archs, stamp)


def werror_checked() -> str | None:
    """None when the build in place, of these exact sources, compiled every C++ source with
    WARNINGS; else why not. (The variant load() would take: the CUDA one where it can be built.)"""
    import torch  # noqa: F401

    plan = _build_plan(cuda_build_possible() is None)
    if not _stamped(plan.folder / STAMP, plan.stamp):
        return f"no build of these sources in {plan.folder}"
    if not _stamped(plan.folder / WERROR_STAMP, plan.stamp):
        return f"{plan.folder} was built without {' '.join(WARNINGS)}"
    return None


def _build(with_cuda: bool, verbose: bool, werror: bool = False):
    from torch.utils import cpp_extension

    name, files, folder, cflags, cuda_flags, archs, stamp = _build_plan(with_cuda)
    module = _import_built(name, folder, stamp)  # no lock, no write: a read-only checkout's build loads
    if module is None:
        _check_tools()
        what = f"{len(files)} sources for cpu" + (" and cuda" if with_cuda else "") + f" into {folder}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with _folder_lock(folder):
                module = _import_built(name, folder, stamp)  # another process built it while we waited
                if module is None:
                    # No stamp until the build succeeds: one left from before would vouch for whatever
                    # .so a failed build leaves behind.
                    (folder / STAMP).unlink(missing_ok=True)
                    (folder / WERROR_STAMP).unlink(missing_ok=True)
                    built = _drop_stale_objects(folder, files)
                    with _Ticker(what):
                        module = cpp_extension.load(
                            name,
                            [str(f) for f in files],
                            extra_cflags=cflags + (WARNINGS if werror else []),
                            extra_cuda_cflags=cuda_flags,
                            extra_ldflags=["-fopenmp"],
                            build_directory=str(folder),
                            verbose=verbose,
                        )
                    (folder / OBJECTS).write_text(json.dumps(built))
                    (folder / STAMP).write_text(stamp)
                    if werror:
                        (folder / WERROR_STAMP).write_text(stamp)
        except PermissionError as e:
            raise KernelBuildError(
                f"cannot write the build folder {folder} ({e.strerror}): set KERNELS_BUILD_DIR to a writable one"
            ) from None
        except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as e:
            # a failed compile is a RuntimeError, a bad link an ImportError, a compiler that fails
            # torch's own check a CalledProcessError
            tail = "\n".join(str(e).strip().splitlines()[-25:])
            raise KernelBuildError(f"building kernels/ failed ({what})\n{tail}") from None
    module.cuda_archs = archs  # what kernels.gpu_not_covered() reads
    from kernels import fake

    fake.register()  # the operators torch.ops.llm_kernels.* now exist: say what they return
    return module


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kernels.build", description="Build kernels/csrc/ if needed, load it and say what it holds."
    )
    ap.add_argument("--verbose", action="store_true", help="show the compiler's commands and output")
    ap.add_argument("--werror", action="store_true", help=f"compile with {' '.join(WARNINGS)} (where a build is due)")
    ap.add_argument(
        "--werror-checked",
        action="store_true",
        help=f"build nothing; exit 0 if the build in place compiled with {' '.join(WARNINGS)}, else 1",
    )
    args = ap.parse_args()
    if args.werror_checked:
        why_not = werror_checked()
        print(f"kernels: {why_not}" if why_not else f"kernels: every C++ source compiled with {' '.join(WARNINGS)}")
        return 1 if why_not else 0
    try:
        ext = load(verbose=args.verbose, werror=args.werror)
    except KernelBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    why_not = cuda_build_possible()
    print(f"kernels: {ext.__file__}")
    print(f"  cpu: {ext.cpu_isa()} (best here: {ext.best_cpu_isa()})")
    print(f"  cuda: {'built' if ext.with_cuda else 'not built: ' + (why_not or 'its build failed (above)')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
