"""The ctypes mirror against include/tilewire.h: struct layouts (as the C compiler lays them
out, via python/tools/struct_layout.c), enum values, constants and every function's
prototype. Host only: needs a C compiler, not a GPU."""

import ctypes
import json
import subprocess

import pytest

import _header
from tilewire import _lib


@pytest.fixture(scope="session")
def c_layout(root, c_compiler, tmp_path_factory):
    exe = tmp_path_factory.mktemp("layout") / "struct_layout"
    cmd = [c_compiler, "-std=c11", "-Wall", "-Wextra", "-Werror", "-I", str(root / "include"),
           str(root / "python" / "tools" / "struct_layout.c"), "-o", str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True)
    assert build.returncode == 0, "%s\n%s" % (" ".join(cmd), build.stderr)
    run = subprocess.run([str(exe)], capture_output=True, text=True, check=True)
    return json.loads(run.stdout)


def test_every_header_struct_is_in_the_c_program_and_the_binding(header_text, c_layout):
    declared = _header.structs(header_text)
    assert set(declared) == set(c_layout["structs"]), "update python/tools/struct_layout.c"
    assert set(declared) == set(_lib.STRUCTS), "update _lib.STRUCTS"
    for name, fields in declared.items():
        c_fields = [f[0] for f in c_layout["structs"][name]["fields"]]
        assert c_fields == fields, "struct_layout.c lists %s's fields as %s" % (name, c_fields)
        py_fields = [f[0] for f in _lib.STRUCTS[name]._fields_]
        assert py_fields == fields, "_lib.%s fields" % _lib.STRUCTS[name].__name__


@pytest.mark.parametrize("name", sorted(_lib.STRUCTS))
def test_struct_layout_matches_c(name, c_layout):
    c = c_layout["structs"][name]
    cls = _lib.STRUCTS[name]
    assert ctypes.sizeof(cls) == c["size"], "sizeof(%s)" % name
    assert ctypes.alignment(cls) == c["align"], "alignof(%s)" % name
    for field, offset, size in c["fields"]:
        descriptor = getattr(cls, field)
        assert descriptor.offset == offset, "offsetof(%s, %s)" % (name, field)
        assert descriptor.size == size, "sizeof(%s.%s)" % (name, field)


def test_enum_sizes_are_int(c_layout):
    for name, size in c_layout["enum_sizes"].items():
        assert size == ctypes.sizeof(_lib.c_enum), name


def test_enums_match_header(header_text, c_layout):
    declared = _header.enums(header_text)
    assert set(declared) == set(_lib.ENUMS), "an enum of tilewire.h is missing from _lib.ENUMS"
    for typedef, values in declared.items():
        enum_cls, prefix = _lib.ENUMS[typedef]
        mirrored = {prefix + member.name: int(member) for member in enum_cls}
        assert mirrored == values, typedef
        for c_name, value in values.items():
            assert c_layout["enums"].get(c_name) == value, "struct_layout.c: " + c_name


def test_constants_match_header(header_text, c_layout):
    for name, value in c_layout["constants"].items():
        assert getattr(_lib, name) == value, name
    for name, value in _header.defines(header_text).items():
        assert getattr(_lib, name) == value, name


_BASE = {
    "int": ctypes.c_int,
    "size_t": ctypes.c_size_t,
    "int64_t": ctypes.c_int64,
    "tw_status_t": _lib.c_enum,
    "tw_comm_t": _lib.tw_comm_t,
    "tw_stream_t": _lib.tw_stream_t,
    "char": ctypes.c_char,
}


def _expected_ctype(base, stars):
    """The ctypes type the binding should use for a C type `base` with `stars` pointers."""
    if base == "void":
        # void *: c_void_p; void ** and void *const ** (an out-parameter receiving a
        # pointer): a pointer to c_void_p.
        return ctypes.c_void_p if stars == 1 else ctypes.POINTER(ctypes.c_void_p)
    if base in _lib.STRUCTS:
        t = _lib.STRUCTS[base]
    else:
        t = _BASE[base]
    if t is ctypes.c_char and stars >= 1:
        t, stars = ctypes.c_char_p, stars - 1
    for _ in range(stars):
        t = ctypes.POINTER(t)
    return t


def test_every_function_is_bound_with_the_header_prototype(header_text):
    declared = _header.functions(header_text)
    assert declared, "no TW_API functions parsed from tilewire.h"
    missing = sorted(set(declared) - set(_lib.FUNCTIONS))
    assert not missing, "functions of tilewire.h missing from _lib.FUNCTIONS: %s" % missing
    extra = sorted(set(_lib.FUNCTIONS) - set(declared))
    assert not extra, "_lib.FUNCTIONS has functions tilewire.h does not declare: %s" % extra
    for name, proto in declared.items():
        restype, argtypes = _lib.FUNCTIONS[name]
        assert restype is _expected_ctype(*proto["ret"]), "%s: return type" % name
        assert len(argtypes) == len(proto["params"]), "%s: parameter count" % name
        for i, (base, stars, pname) in enumerate(proto["params"]):
            assert argtypes[i] is _expected_ctype(base, stars), "%s: parameter %d (%s)" % (
                name, i, pname)


def test_the_library_exports_every_function():
    assert _lib.missing_functions() == (), (
        "%s lacks %s: rebuild it" % (_lib.library_path(), _lib.missing_functions())
    )


def test_every_versioned_struct_has_an_initialiser(header_text):
    structs = _header.structs(header_text)
    versioned = [n for n, fields in structs.items() if fields[:2] == ["size", "version"]]
    assert sorted(versioned) == sorted(_lib.INIT_FUNCTIONS)
    functions = _header.functions(header_text)
    assert all(f in functions for f in _lib.INIT_FUNCTIONS.values())


@pytest.mark.parametrize("struct", sorted(_lib.INIT_FUNCTIONS))
def test_init_macros_match_the_c_init_functions(struct):
    # tw_*_init fills the struct as its _INIT macro does; the Python constructor must give
    # the same bytes, with size and version set.
    init = _lib.INIT_FUNCTIONS[struct]
    if init in _lib.missing_functions():
        pytest.skip("%s is not in this build of the library" % init)
    cls = _lib.STRUCTS[struct]
    assert bytes(cls()) == bytes(_lib.c_init(struct))
    assert cls().size == ctypes.sizeof(cls) and cls().version == cls._version_ >= 1
