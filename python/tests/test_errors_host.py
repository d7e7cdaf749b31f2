"""Host tests of the error mapping: every tw_status_t of include/tilewire.h has its own
TilewireError subclass, and refusals the library makes before touching a GPU (a NULL comm, a bad
tw_gemm or tw_grouped_gemm shape) reach Python as that subclass with the library's message. No
GPU, no torch."""

import ctypes
import pickle

import pytest

import _header
import tilewire
from tilewire import _errors, _lib


def _header_statuses(header_text):
    """tw_status_t's constants in include/tilewire.h, name -> value."""
    return _header.enums(header_text)["tw_status_t"]


def test_every_header_status_maps_to_its_own_error_class(header_text):
    classes = {}
    for c_name, value in _header_statuses(header_text).items():
        status = _errors.Status(value)
        assert status.c_name == c_name
        if status == _errors.Status.SUCCESS:
            assert status not in _errors.ERROR_CLASSES
            continue
        cls = _errors.ERROR_CLASSES.get(status)
        assert cls is not None, "%s has no entry in _errors.ERROR_CLASSES" % c_name
        assert issubclass(cls, _errors.TilewireError) and cls is not _errors.TilewireError, c_name
        assert cls.__doc__.startswith(c_name + ":"), "%s's docstring: %s" % (cls.__name__, c_name)
        err = _errors.error_for(value, "the message", "tw_fn")
        assert type(err) is cls and err.status == status and err.status_name == c_name
        assert err.message == "the message" and err.function == "tw_fn"
        classes[c_name] = cls
    assert len(set(classes.values())) == len(classes), "two statuses share a class: %s" % classes


def test_mismatch_maps_to_mismatch_error():
    assert int(_errors.Status.ERR_MISMATCH) == 13
    assert _errors.Status.ERR_MISMATCH.c_name == "TW_ERR_MISMATCH"
    assert _errors.ERROR_CLASSES[_errors.Status.ERR_MISMATCH] is _errors.MismatchError
    message = "tw_gemm_rs: ranks 0 and 1 disagree on args->n (256 and 264)"
    err = _errors.error_for(13, message, "tw_gemm_rs")
    assert type(err) is _errors.MismatchError
    assert isinstance(err, tilewire.TilewireError)
    # not a bad argument of this rank's call: the ranks' calls disagree, and the comm is gone
    assert not isinstance(err, (ValueError, tilewire.InvalidArgumentError))
    assert str(err) == "tw_gemm_rs: TW_ERR_MISMATCH: " + message


@pytest.mark.parametrize("status", [s for s in _errors.Status if s != _errors.Status.SUCCESS],
                         ids=lambda s: s.c_name)
def test_errors_keep_their_class_through_pickle(status):
    # torch.multiprocessing hands a worker's exception to the parent by pickle
    err = _errors.error_for(status, "msg", "tw_fn")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert (back.status, back.message, back.function) == (status, "msg", "tw_fn")
    assert str(back) == str(err)


# ---- refusals that need no GPU --------------------------------------------------------------


def _refused(call, function, *needles):
    """call() raises InvalidArgumentError from `function` whose message holds every needle."""
    with pytest.raises(tilewire.InvalidArgumentError) as info:
        call()
    err = info.value
    assert isinstance(err, tilewire.TilewireError) and isinstance(err, ValueError)
    assert err.status == tilewire.Status.ERR_INVALID_ARGUMENT
    assert err.function == function
    for needle in needles:
        assert needle in err.message and needle in str(err), (needle, str(err))
    return err


@pytest.mark.parametrize("fields,needle", [
    ({"m": -1, "n": 8, "k": 8}, "tw_gemm: m is -1"),
    ({"m": 1, "n": 0, "k": 8}, "tw_gemm: n is 0"),
    ({"m": 1, "n": -8, "k": 8}, "tw_gemm: n is -8"),
    ({"m": 1, "n": 8, "k": 0}, "tw_gemm: k is 0"),
    ({"m": 1, "n": 8, "k": -8}, "tw_gemm: k is -8"),
    ({"m": 8, "n": 8, "k": 8, "lda": 4}, "tw_gemm: lda is 4"),
    ({"m": 8, "n": 8, "k": 8, "c_dtype": 7}, "tw_gemm: c_dtype is 7"),
])
def test_gemm_shape_refusals_name_the_field(fields, needle):
    # tw_gemm checks the shape fields before the pointers and before it asks for a device
    args = tilewire.GemmArgs(**fields)
    _refused(lambda: _lib.call("tw_gemm", ctypes.byref(args), None), "tw_gemm", needle)


def test_gemm_null_args():
    _refused(lambda: _lib.call("tw_gemm", None, None), "tw_gemm", "tw_gemm: args is NULL")


@pytest.mark.parametrize("fields,needle", [
    ({"m": 128, "n": 8, "k": 8, "groups": 0}, "tw_grouped_gemm: groups is 0"),
    ({"m": 128, "n": 8, "k": 8, "groups": 65537}, "tw_grouped_gemm: groups is 65537"),
    ({"m": 0, "n": 8, "k": 8, "groups": 1}, "tw_grouped_gemm: m is 0"),
    ({"m": 128, "n": 12, "k": 8, "groups": 1}, "tw_grouped_gemm: n is 12"),
    ({"m": 128, "n": 8, "k": 4, "groups": 1}, "tw_grouped_gemm: k is 4"),
    ({"m": 128, "n": 8, "k": 8, "groups": 1, "ldb": 4}, "tw_grouped_gemm: ldb is 4"),
    ({"m": 128, "n": 8, "k": 8, "groups": 1, "c_dtype": 1}, "tw_grouped_gemm: c_dtype is 1"),
    ({"m": 128, "n": 8, "k": 8, "groups": 1}, "tw_grouped_gemm: a is NULL"),
    ({"m": 128, "n": 8, "k": 8, "groups": 1, "a": 16, "b": 16, "out": 16},
     "tw_grouped_gemm: offsets is NULL"),
])
def test_grouped_gemm_refusals_name_the_field(fields, needle):
    # tw_grouped_gemm checks the shape fields and the pointers' presence before it asks for a
    # device
    args = tilewire.GroupedGemmArgs(**fields)
    _refused(lambda: _lib.call("tw_grouped_gemm", ctypes.byref(args), None), "tw_grouped_gemm",
             needle)


def test_grouped_gemm_null_and_short_args():
    _refused(lambda: _lib.call("tw_grouped_gemm", None, None), "tw_grouped_gemm",
             "tw_grouped_gemm: args is NULL")
    short = tilewire.GroupedGemmArgs(m=128, n=8, k=8, groups=1)
    short.size = 8
    _refused(lambda: _lib.call("tw_grouped_gemm", ctypes.byref(short), None), "tw_grouped_gemm",
             "args->size is 8")


@pytest.mark.parametrize("function,make", [
    ("tw_gemm", tilewire.GemmArgs),
    ("tw_grouped_gemm", tilewire.GroupedGemmArgs),
    ("tw_attention", tilewire.AttentionArgs),
    ("tw_attention_backward", tilewire.AttentionBackwardArgs),
])
def test_versioned_args_refused_when_short_or_oversized(function, make):
    # tw_args_copy, shared by the single-GPU ops: NULL, fewer bytes than every version has, or
    # far more than the struct, before anything asks for a device
    _refused(lambda: _lib.call(function, None, None), function, function + ": args is NULL")
    for size in (8, ctypes.sizeof(make) + 4097):
        args = make()
        args.size = size
        _refused(lambda: _lib.call(function, ctypes.byref(args), None), function,
                 "args->size is %d" % size)


@pytest.mark.parametrize("function,args", [
    ("tw_gemm_rs", lambda: (ctypes.byref(tilewire.GemmRsArgs()), None)),
    ("tw_gemm_ar", lambda: (ctypes.byref(tilewire.GemmRsArgs()), None)),
    ("tw_ag_gemm", lambda: (ctypes.byref(tilewire.AgGemmArgs()), None)),
    ("tw_moe_dispatch", lambda: (ctypes.byref(tilewire.MoeArgs()), None)),
    ("tw_moe_combine", lambda: (ctypes.byref(tilewire.MoeArgs()), None)),
    ("tw_moe_dispatch_gemm", lambda: (ctypes.byref(tilewire.MoeArgs()), None)),
    ("tw_moe_gemm_combine", lambda: (ctypes.byref(tilewire.MoeArgs()), None)),
    ("tw_moe_ffn", lambda: (ctypes.byref(tilewire.MoeArgs()), None)),
    ("tw_moe_workspace_size", lambda: (16, 0, 8, 2, ctypes.byref(ctypes.c_size_t()))),
    ("tw_allgather", lambda: (None, None, ctypes.c_size_t(16), None)),
    ("tw_barrier", lambda: (None,)),
])
def test_collectives_refuse_a_null_comm(function, args):
    # tw_comm_last_error(NULL) reports the refusal: the message reaches Python all the same
    err = _refused(lambda: _lib.call(function, None, *args()), function, "comm: NULL")
    assert str(err) == "%s: TW_ERR_INVALID_ARGUMENT: %s" % (function, err.message)


@pytest.mark.parametrize("h,act,rows,inter,needles", [
    (None, None, -1, 8, ["tw_swiglu: rows is -1"]),
    (None, None, 4, 12, ["tw_swiglu: inter is 12", "positive multiple of 8"]),
    (None, None, 4, 0, ["tw_swiglu: inter is 0"]),
    (None, None, 4, 8, ["tw_swiglu: h (", "NULL or not 16-byte aligned"]),
    # a non-NULL first argument: call() must not take it for a comm (_lib._NO_COMM)
    (8, 16, 4, 8, ["tw_swiglu: h (0x8) is NULL or not 16-byte aligned"]),
    (16, None, 4, 8, ["tw_swiglu: act (", "NULL or not 16-byte aligned"]),
    (16, 24, 4, 8, ["tw_swiglu: act (0x18)"]),
])
def test_swiglu_refusals_name_the_argument(h, act, rows, inter, needles):
    # tw_swiglu checks rows, inter and the pointers before it asks for a device; it has no
    # comm, so its message comes from tw_last_error()
    _refused(lambda: _lib.call("tw_swiglu", h, act, rows, inter, None), "tw_swiglu", *needles)
