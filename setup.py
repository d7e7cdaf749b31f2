"""Builds libtilewire.so and tw-bench with CMake and ships them inside the `tilewire` package.

`pip install .` (or `pip install --no-build-isolation .` offline) runs build_py, which
configures CMake if needed and builds the targets `tilewire` and `tw-bench`, then copies
both into the package folder:

    tilewire/libtilewire.so.MAJOR   the library, under its soname (tilewire/_lib.py loads it)
    tilewire/tw-bench               the benchmark; its RUNPATH ($ORIGIN, set by the CMake
                                    build) finds the library beside it; python -m
                                    tilewire.bench runs it

The version is TW_VERSION_MAJOR/MINOR/PATCH of include/tilewire.h, the one place it lives.
Other metadata lives in pyproject.toml.

Settings (environment):
  TILEWIRE_CMAKE_BUILD_DIR  CMake build folder (default: build/ of this tree when it is
                            unconfigured or configured for this tree, else a temporary one)
  TILEWIRE_CMAKE_ARGS       extra arguments for the CMake configure step
  TILEWIRE_BUILD_JOBS       parallel build jobs (default: CPU count)
  TILEWIRE_BUILD_BENCH      0: build and ship the library only, without tw-bench
"""

import os
import pathlib
import re
import shlex
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = pathlib.Path(__file__).resolve().parent
HEADER = ROOT / "include" / "tilewire.h"
LIBRARY = "libtilewire.so"
BENCH = "tw-bench"


def version():
    """MAJOR.MINOR.PATCH from the TW_VERSION_* defines of include/tilewire.h."""
    text = HEADER.read_text()
    parts = []
    for name in ("MAJOR", "MINOR", "PATCH"):
        m = re.search(r"^\s*#\s*define\s+TW_VERSION_%s\s+(\d+)\s*$" % name, text, re.M)
        if m is None:
            raise RuntimeError("tilewire: %s defines no TW_VERSION_%s" % (HEADER, name))
        parts.append(str(int(m.group(1))))
    return ".".join(parts)


def _cmake_home(build_dir):
    """The source folder a configured CMake build folder belongs to, or None."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.exists():
        return None
    for line in cache.read_text(errors="replace").splitlines():
        if line.startswith("CMAKE_HOME_DIRECTORY:"):
            return pathlib.Path(line.split("=", 1)[1]).resolve()
    return None


def _build_dir(fallback):
    env = os.environ.get("TILEWIRE_CMAKE_BUILD_DIR")
    if env:
        return pathlib.Path(env).resolve()
    default = ROOT / "build"
    home = _cmake_home(default)
    if home is None or home == ROOT:
        return default
    return pathlib.Path(fallback).resolve() / "cmake"


def _run(cmd):
    print("tilewire setup: " + " ".join(shlex.quote(str(c)) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT)


def _want_bench():
    return os.environ.get("TILEWIRE_BUILD_BENCH", "1") != "0"


def build_native(fallback_dir):
    """Configures (if needed) and builds the targets `tilewire` and (unless
    TILEWIRE_BUILD_BENCH=0) `tw-bench`; returns the build folder."""
    if not shutil.which("cmake"):
        raise RuntimeError("tilewire: cmake (>= 3.24) is needed to build libtilewire.so")
    build_dir = _build_dir(fallback_dir)
    if _cmake_home(build_dir) is None:
        cmd = ["cmake", "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release"]
        if shutil.which("ninja"):
            cmd += ["-G", "Ninja"]
        if not shutil.which("nvcc") and pathlib.Path("/usr/local/cuda/bin/nvcc").exists():
            cmd.append("-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc")
        cmd += shlex.split(os.environ.get("TILEWIRE_CMAKE_ARGS", ""))
        _run(cmd)
    jobs = os.environ.get("TILEWIRE_BUILD_JOBS") or str(os.cpu_count() or 2)
    targets = ["tilewire"] + ([BENCH] if _want_bench() else [])
    _run(["cmake", "--build", build_dir, "--target", *targets, "-j", jobs])
    return build_dir


def soname(build_dir):
    """The library's soname as CMake lays it out: libtilewire.so -> libtilewire.so.MAJOR ->
    libtilewire.so.MAJOR.MINOR.PATCH (libtilewire.so itself when it is not versioned)."""
    lib = build_dir / LIBRARY
    if not lib.exists():
        raise RuntimeError("tilewire: the build did not produce %s" % lib)
    name = os.readlink(lib).rsplit("/", 1)[-1] if lib.is_symlink() else LIBRARY
    expected = "%s.%s" % (LIBRARY, version().split(".")[0])  # what tilewire/_lib.py loads
    if name not in (expected, LIBRARY):
        raise RuntimeError("tilewire: %s's soname is %s, not %s (the major version of %s)"
                           % (lib, name, expected, HEADER))
    return name


def _copy(src, dst):
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    os.chmod(dst, 0o755)


class BuildPyWithNative(build_py):
    """build_py that also builds libtilewire.so and tw-bench and copies them into the
    package."""

    def run(self):
        super().run()
        build_dir = build_native(self.get_finalized_command("build").build_temp)
        if getattr(self, "editable_mode", False):
            # An editable install imports python/tilewire, which finds build/libtilewire.so
            # and build/tw-bench of this tree by itself (tilewire/_lib.py, tilewire/bench.py).
            return
        package = pathlib.Path(self.build_lib) / "tilewire"
        # One file, the versioned library the symlinks point at, under the soname that
        # tw-bench's NEEDED entry names (wheels keep no symlinks).
        _copy((build_dir / LIBRARY).resolve(), package / soname(build_dir))
        if _want_bench():
            bench = build_dir / BENCH
            if not bench.exists():
                raise RuntimeError("tilewire: the build did not produce %s" % bench)
            _copy(bench, package / BENCH)


class BinaryDistribution(Distribution):
    """The wheel carries a native library: tag it for the platform."""

    def has_ext_modules(self):
        return True


if __name__ == "__main__":
    setup(
        version=version(),
        cmdclass={"build_py": BuildPyWithNative},
        distclass=BinaryDistribution,
        options={"build": {"build_base": "build/python"}},
    )
