"""Host tests: import, versions, error mapping, comms without a GPU. No GPU and no torch
needed (the torch-facing checks are in test_torch_host.py)."""

import ast
import ctypes
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

import tilewire
from tilewire import _errors, _lib


def _has_gpu():
    try:
        comms = tilewire.init_virtual(1)
    except tilewire.TilewireError:
        return False
    for c in comms:
        c.close()
    return True


def test_import_without_torch_or_library(root, tmp_path):
    # A fresh interpreter: importing the package loads neither torch nor the library.
    code = (
        "import sys, tilewire; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert tilewire._lib._loaded is None, 'library loaded at import'; "
        "print(tilewire.__version__)"
    )
    env = {"PYTHONPATH": str(root / "python"), "TILEWIRE_LIB": str(tmp_path / "absent.so")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == tilewire.__version__


def test_torch_names_without_torch_say_what_is_missing(root, tmp_path):
    # torch made unimportable: the package and its torch-free API still import; a torch name
    # raises an ImportError that says what it needs.
    code = "\n".join([
        "import sys",
        "sys.modules['torch'] = None",
        "import tilewire",
        "from tilewire import bench, bench_dist, bench_grouped",
        "assert tilewire.init_virtual and tilewire.Config()",
        "try:",
        "    tilewire.gemm",
        "except ImportError as e:",
        "    print(e)",
    ])
    env = {"PYTHONPATH": str(root / "python"), "TILEWIRE_LIB": str(tmp_path / "absent.so")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "tilewire.gemm needs PyTorch" in out.stdout, out.stdout


def _package_imports(path):
    """The package's modules a module imports, at its top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "tilewire":
                    found.add(parts[1] if len(parts) > 1 else "__init__")
    return found


def test_the_package_has_no_import_loop(root):
    # Imports inside functions count too: a lazy import is still a loop in the design.
    package = root / "python" / "tilewire"
    graph = {p.stem: _package_imports(p) for p in package.glob("*.py")}
    assert "_torch" in graph and "_comm" in graph
    done, path = set(), []

    def visit(mod):
        if mod in path:
            raise AssertionError("import loop: " + " -> ".join(path[path.index(mod):] + [mod]))
        if mod in done or mod not in graph:
            return
        path.append(mod)
        for dep in sorted(graph[mod]):
            visit(dep)
        path.pop()
        done.add(mod)

    for mod in sorted(graph):
        visit(mod)


def test_missing_library_is_a_clear_error(root, tmp_path):
    code = "import tilewire; tilewire.library_version()"
    env = {"PYTHONPATH": str(root / "python"), "TILEWIRE_LIB": str(tmp_path / "absent.so")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode != 0
    assert "LibraryNotFoundError" in out.stderr and "absent.so" in out.stderr


def test_versions_agree(root, header_text):
    code = int(re.search(r"#define TW_VERSION_MAJOR (\d+)", header_text).group(1)) * 10000
    code += int(re.search(r"#define TW_VERSION_MINOR (\d+)", header_text).group(1)) * 100
    code += int(re.search(r"#define TW_VERSION_PATCH (\d+)", header_text).group(1))
    assert tilewire.library_version() == code == _lib.TW_VERSION_CODE
    major, minor, patch = (int(x) for x in tilewire.__version__.split("."))
    assert major * 10000 + minor * 100 + patch == code
    # the header is the one place: pyproject.toml asks setup.py, which parses the header
    pyproject = (root / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"\]', pyproject, re.M)
    assert not re.search(r"^version\s*=", pyproject, re.M)
    pytest.importorskip("setuptools")
    spec = importlib.util.spec_from_file_location("tilewire_setup", root / "setup.py")
    setup_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup_py)  # not __main__: defines, does not run setup()
    assert setup_py.version() == tilewire.__version__


def test_library_path_is_the_one_under_test():
    path = pathlib.Path(tilewire.library_path())
    assert path.name.startswith("libtilewire.so")


def test_status_strings_name_every_status():
    for status in tilewire.Status:
        assert _lib.status_string(status).startswith(status.c_name + ":")


def test_error_classes():
    for status in tilewire.Status:
        if status == tilewire.Status.SUCCESS:
            continue
        err = _errors.error_for(status, "msg", "tw_fn")
        assert isinstance(err, tilewire.TilewireError)
        assert err.status == status and err.status_name == status.c_name
        assert str(err) == "tw_fn: %s: msg" % status.c_name
    assert isinstance(_errors.error_for(1, "m"), ValueError)
    unknown = _errors.error_for(99, "m")
    assert type(unknown) is tilewire.TilewireError and "99" in unknown.status_name


def test_init_all_world_zero_is_invalid_argument():
    with pytest.raises(tilewire.InvalidArgumentError) as info:
        tilewire.init_virtual(0)
    err = info.value
    assert err.status == tilewire.Status.ERR_INVALID_ARGUMENT
    assert err.status_name == "TW_ERR_INVALID_ARGUMENT"
    assert "world" in err.message
    assert err.function == "tw_comm_init_all"
    assert isinstance(err, ValueError)


def test_init_all_world_too_large():
    with pytest.raises(tilewire.InvalidArgumentError, match="world"):
        tilewire.init_virtual(_lib.TW_MAX_WORLD + 1)


def test_init_virtual_without_gpu_is_no_device():
    if _has_gpu():
        pytest.skip("a GPU is present")
    with pytest.raises(tilewire.NoDeviceError) as info:
        tilewire.init_virtual(2)
    assert info.value.status == tilewire.Status.ERR_NO_DEVICE
    assert info.value.message


def test_init_rank_without_gpu_fails_cleanly():
    if _has_gpu():
        pytest.skip("a GPU is present")
    with pytest.raises(tilewire.TilewireError) as info:
        tilewire.init_rank(1, 0, tilewire.get_unique_id())
    assert info.value.status in (tilewire.Status.ERR_NO_DEVICE, tilewire.Status.ERR_CUDA)


def test_init_rank_argument_errors():
    uid = tilewire.get_unique_id()
    with pytest.raises(tilewire.InvalidArgumentError, match="rank"):
        tilewire.init_rank(2, 5, uid)
    with pytest.raises(ValueError, match="128 bytes"):
        tilewire.init_rank(1, 0, b"short")


def test_unique_ids_are_128_distinct_bytes():
    a, b = tilewire.get_unique_id(), tilewire.get_unique_id()
    assert len(a) == len(b) == 128 and a != b
    assert bytes(tilewire.UniqueId.from_bytes(a)) == a


def test_comm_calls_report_the_comm_message():
    # A NULL comm: tw_comm_last_error(NULL) says so and the call names the function.
    with pytest.raises(tilewire.InvalidArgumentError, match="tw_comm_rank: .*comm: NULL"):
        _lib.call("tw_comm_rank", None, ctypes.byref(ctypes.c_int()))


def test_gemm_argument_errors_need_no_gpu():
    args = tilewire.GemmArgs(m=1, n=8, k=7)
    with pytest.raises(tilewire.InvalidArgumentError, match="k is 7"):
        _lib.call("tw_gemm", ctypes.byref(args), None)
    args = tilewire.GemmArgs(m=0, n=8, k=8)
    with pytest.raises(tilewire.InvalidArgumentError, match="m is 0"):
        _lib.call("tw_gemm", ctypes.byref(args), None)
    short = tilewire.GemmArgs(m=1, n=8, k=8)
    short.size = 8
    with pytest.raises(tilewire.InvalidArgumentError, match="size"):
        _lib.call("tw_gemm", ctypes.byref(short), None)


def test_config_fields():
    cfg = tilewire.Config(sm_budget=16, heap_bytes=1 << 30)
    assert cfg.sm_budget == 16 and cfg.heap_bytes == 1 << 30
    assert "sm_budget=16" in repr(cfg)
    with pytest.raises(TypeError, match="no field"):
        tilewire.Config(sm_budgett=1)


def test_env_knobs():
    knobs = tilewire.env_knobs()
    assert len(knobs) == _lib.function("tw_env_count")() > 0
    for k in knobs:
        assert k["name"].startswith("TW_") and k["description"]


def test_comm_object_without_gpu():
    # Comm wraps a handle; a NULL one is refused before any call.
    with pytest.raises(ValueError):
        tilewire.Comm(None)


def test_transport_info_names_rdma_core_or_why_not():
    text = tilewire.transport_info()
    # rdma-core found: its version and a device count; absent: the reason, never an empty answer
    assert text and ("rdma-core" in text or "none:" in text), text
