"""pytest setup: import tilewire from python/ and load build/libtilewire.so of this tree.

Host tests need only the C library (`make`, or `cmake --build build --target tilewire`).
GPU tests skip without torch or without a CUDA Hopper (sm_90) GPU.
"""

import os
import pathlib
import shutil
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYTHON_DIR = ROOT / "python"

if str(PYTHON_DIR) not in sys.path:
    sys.path.insert(0, str(PYTHON_DIR))

# The GPU tests run virtual ranks in this process: set before anything initialises CUDA (loads no
# library and no torch).
from tilewire._comm import set_shared_gpu_env  # noqa: E402

set_shared_gpu_env()

_built = ROOT / "build" / "libtilewire.so"
if "TILEWIRE_LIB" not in os.environ and _built.exists():
    os.environ["TILEWIRE_LIB"] = str(_built)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs torch and a CUDA Hopper (sm_90) GPU")


@pytest.fixture(scope="session")
def root():
    return ROOT


@pytest.fixture(scope="session")
def header_text():
    return (ROOT / "include" / "tilewire.h").read_text()


@pytest.fixture(scope="session")
def c_compiler():
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    pytest.skip("no C compiler (cc, gcc, clang) to build python/tools/struct_layout.c")


def _hopper_reason():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return "GPU is sm_%d%d, not Hopper (sm_90)" % (major, minor)
    return None


@pytest.fixture(scope="session")
def hopper():
    """Skips unless torch sees a Hopper GPU; returns the torch module."""
    reason = _hopper_reason()
    if reason:
        pytest.skip(reason)
    import torch

    return torch


@pytest.fixture
def hopper_synced(hopper):
    """hopper, then the device's work waited for after the test, so that an asynchronous
    failure shows in the test that caused it (the GPU tests of test_gpu_*.py use it)."""
    yield hopper
    hopper.cuda.synchronize()
