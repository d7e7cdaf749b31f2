"""Builds libtilewire.so with CMake and ships it inside the `tilewire` Python package.

`pip install .` (or `pip install --no-build-isolation .` offline) runs build_py, which
configures CMake if needed and builds only the `tilewire` target, then copies the library
into the package. Metadata lives in pyproject.toml.

Knobs (environment):
  TILEWIRE_CMAKE_BUILD_DIR  CMake build folder (default: build/ of this tree when it is
                            unconfigured or configured for this tree, else a temporary one)
  TILEWIRE_CMAKE_ARGS       extra arguments for the CMake configure step
  TILEWIRE_BUILD_JOBS       parallel build jobs (default: CPU count)
"""

import os
import pathlib
import shlex
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = pathlib.Path(__file__).resolve().parent
LIBRARY = "libtilewire.so"


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


def build_library(fallback_dir):
    """Configures (if needed) and builds target `tilewire`; returns the library's path."""
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
    _run(["cmake", "--build", build_dir, "--target", "tilewire", "-j", jobs])
    lib = build_dir / LIBRARY
    if not lib.exists():
        raise RuntimeError("tilewire: the build did not produce %s" % lib)
    return lib


class BuildPyWithLibrary(build_py):
    """build_py that also builds libtilewire.so and copies it into the package."""

    def run(self):
        super().run()
        lib = build_library(self.get_finalized_command("build").build_temp)
        if getattr(self, "editable_mode", False):
            # An editable install imports python/tilewire, which finds build/libtilewire.so
            # of this tree by itself (see tilewire/_lib.py).
            return
        dst = pathlib.Path(self.build_lib) / "tilewire" / LIBRARY
        dst.parent.mkdir(parents=True, exist_ok=True)
        # One file (the versioned library the symlinks point at), loaded by path.
        shutil.copyfile(lib.resolve(), dst)
        os.chmod(dst, 0o755)


class BinaryDistribution(Distribution):
    """The wheel carries a native library: tag it for the platform."""

    def has_ext_modules(self):
        return True


setup(
    cmdclass={"build_py": BuildPyWithLibrary},
    distclass=BinaryDistribution,
    options={"build": {"build_base": "build/python"}},
)
