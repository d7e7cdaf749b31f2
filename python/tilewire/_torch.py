"""The PyTorch front end: init under torchrun, symmetric tensors, and one function per op.

Imported on first use of a torch-facing name (``tilewire.gemm``, ``tilewire.init``, ...), so
``import tilewire`` works without torch. Importing this module registers the custom ops
(``torch.ops.tilewire.*``) that make the ops traceable by torch.compile.

Every op is two pieces:

1. a public function that validates its arguments (type, dtype, shape, strides, device;
   clear TypeError/ValueError naming the argument; only metadata, so it also runs on
   torch.compile's fake tensors) and calls the custom op;
2. a ``torch.library.custom_op`` whose implementation launches on torch's current CUDA
   stream (no host synchronisation: CUDA-graph capturable) plus a ``register_fake`` that
   gives torch.compile the output's metadata.

Comms travel through custom ops as their integer ``Comm.id``.
"""

import ctypes
import datetime
import itertools
import math
import os

import torch

from . import _comm, _dlpack, _lib
from ._comm import Comm, comm_by_id

_HAVE_CUSTOM_OP = hasattr(torch.library, "custom_op") and hasattr(torch.library, "register_fake")

# torch dtype -> DLPack (code, bits)
_DLPACK_DTYPES = {
    torch.bfloat16: (_dlpack.KDL_BFLOAT, 16),
    torch.float16: (_dlpack.KDL_FLOAT, 16),
    torch.float32: (_dlpack.KDL_FLOAT, 32),
    torch.float64: (_dlpack.KDL_FLOAT, 64),
    torch.int8: (_dlpack.KDL_INT, 8),
    torch.int16: (_dlpack.KDL_INT, 16),
    torch.int32: (_dlpack.KDL_INT, 32),
    torch.int64: (_dlpack.KDL_INT, 64),
    torch.uint8: (_dlpack.KDL_UINT, 8),
}


def _custom_op(name, mutates_args=()):
    """torch.library.custom_op on CUDA, or the plain function on a torch without it."""

    def wrap(fn):
        if not _HAVE_CUSTOM_OP:
            return fn
        return torch.library.custom_op(name, mutates_args=mutates_args, device_types="cuda")(fn)

    return wrap


def _register_fake(op):
    def wrap(fn):
        if _HAVE_CUSTOM_OP:
            op.register_fake(fn)
        return fn

    return wrap


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
# The current device's index, through torch's raw accessor where it has one.
_current_device = getattr(torch._C, "_cuda_getDevice", None) or (
    lambda: torch.cuda.current_device())


def _stream(device):
    """The cudaStream_t of torch's current stream on `device` (a torch.device with an index).
    torch's raw accessor where it has one (what its own compiled kernels use: a fraction of
    a microsecond, against several for torch.cuda.current_stream)."""
    if _raw_stream is not None and device.index is not None:
        return ctypes.c_void_p(_raw_stream(device.index))
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


# ---- eager calls without the dispatcher ----------------------------------------------------
#
# A torch.library.custom_op call costs tens of microseconds of host time in eager mode (the
# dispatcher, autograd and in-place bookkeeping, measured with python -m tilewire.bench_dist
# --host), more than the C call it wraps and than a whole torch.matmul. Where nothing needs
# the dispatcher (no torch.compile tracing, plain tensors, no dispatch or function mode, no
# autograd to record), the public functions call the op's implementation directly and bump
# the mutated tensors' version counters as the dispatcher would; anything else goes through
# torch.ops.tilewire.* as before. TILEWIRE_EAGER_DISPATCH=1 forces the dispatcher path.

_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (
    lambda: False)
try:
    from torch.utils._python_dispatch import _get_current_dispatch_mode
except ImportError:  # an old torch: always the dispatcher
    _get_current_dispatch_mode = None
_torch_function_mode = getattr(torch._C, "_is_torch_function_mode_enabled", None)
# One tensor per call: torch's public wrapper takes a tensor in every version that has it
# (the private function it wraps takes an iterable of tensors in recent torch: given one
# tensor it would iterate over its elements).
_increment_version = getattr(getattr(torch.autograd, "graph", None), "increment_version", None)
_FAST_EAGER = (_HAVE_CUSTOM_OP and _get_current_dispatch_mode is not None
               and _torch_function_mode is not None and _increment_version is not None
               and os.environ.get("TILEWIRE_EAGER_DISPATCH", "0") in ("", "0"))


# Tensor types the direct path takes: plain tensors and nn.Parameter, whose __torch_function__
# is torch's disabled default (a model's weights are Parameters; any other subclass may
# override dispatch, so it goes through the dispatcher).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _direct_ok(tensors, mutated):
    """True when an op call on `tensors` (None entries ignored) that writes `mutated` can skip
    the dispatcher (see above)."""
    if not _FAST_EAGER or _is_compiling() or _get_current_dispatch_mode() is not None \
            or _torch_function_mode():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or (grad and t.requires_grad)):
            return False
    if not torch.is_inference_mode_enabled():
        for t in mutated:
            if t.is_inference():  # the dispatcher raises the right error for these
                return False
    return True


def _mutated(tensors):
    """What the dispatcher's in-place bookkeeping does for a mutating op's written tensors
    (outside inference mode, where tensors have no version counter)."""
    if not torch.is_inference_mode_enabled():
        for t in tensors:
            _increment_version(t)


def _call_mutating(dispatched, impl, tensors, mutated, *args):
    """One call of a mutating op: its implementation impl(*args) directly where nothing needs
    the dispatcher (or torch has no custom ops), else dispatched(*args), the call of its
    torch.ops.tilewire op (spelled out at each call site, as torch.compile traces it).
    tensors: the call's tensors (None allowed); mutated: those it writes. Returns what impl
    returned when it ran directly (the fast lane's args struct, below), else None."""
    if _direct_ok(tensors, mutated):
        _mutated(mutated)
        return impl(*args)
    if _HAVE_CUSTOM_OP:
        dispatched(*args)
    else:
        impl(*args)
    return None


# ---- the eager fast lane -------------------------------------------------------------------
#
# On the direct path most of a call's host time was still this file's own Python: the
# argument checks and the ctypes args struct built field by field (python -m
# tilewire.bench_dist --host). So a call that ran directly and reached the library leaves its
# args struct here, under the call's signature: every tensor's shape, strides, dtype and
# device, the scalar arguments with their types, and, where a check reads them, the symmetric
# tensors' addresses with their comm's allocation generation. A later direct call with the
# same signature passed the same checks, so it copies the struct, sets the data pointers that
# may change (checked 16-byte aligned), and calls the library, which still validates every
# argument. Anything else (a new signature, a misaligned pointer, a call the direct path
# refuses) goes the whole way. TILEWIRE_FAST_LANE=0 turns the lane off. Not while
# torch.compile traces (dynamo cannot trace the signature's hash; the traced op is the
# custom op anyway).

_LANE_MAX = 1024
_lane = {}
_LANE_ON = _FAST_EAGER and os.environ.get("TILEWIRE_FAST_LANE", "1") in ("", "1")


def _lane_open(*tensors):
    """The lane may be tried: it is on, torch.compile is not tracing, and every tensor given
    (None: not given) is plain (a non-tensor goes the whole way, which raises)."""
    if not _LANE_ON or _is_compiling():
        return False
    for t in tensors:
        if t is not None and type(t) not in _PLAIN:
            return False
    return True


def _meta(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _lane_find(*parts):
    """(the signature tuple, the lane's entry for it or None), hashing it once; (None, None)
    where a part is unhashable (that call goes the whole way and raises what it should)."""
    try:
        return parts, _lane.get(parts)
    except TypeError:
        return None, None


def _lane_put(key, entry):
    """entry: (args struct, anything else the hit needs); the struct is copied."""
    if key is None or entry is None or entry[0] is None:
        return
    if len(_lane) >= _LANE_MAX:
        _lane.clear()
    _lane[key] = (_lane_args(entry[0]),) + tuple(entry[1:])


def _lane_args(tmpl):
    return type(tmpl).from_buffer_copy(tmpl)


class _on_device:
    """Makes `index` the current CUDA device for a call that uses the current device."""

    def __init__(self, index):
        self.index = index
        self.prev = None

    def __enter__(self):
        current = torch.cuda.current_device()
        if current != self.index:
            self.prev = current
            torch.cuda.set_device(self.index)

    def __exit__(self, *exc):
        if self.prev is not None:
            torch.cuda.set_device(self.prev)
        return False


def new_stream(device):
    return torch.cuda.Stream(device=device)


# ---- symmetric tensors --------------------------------------------------------------------


def _shape(shape):
    if isinstance(shape, int):
        shape = (shape,)
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError("shape: %s has a negative dimension" % (shape,))
    return shape


def comm_empty(comm, shape, dtype=None):
    """Comm.empty: a tensor over a fresh tw_mem_alloc allocation (collective).

    The tensor (and every view of it) keeps the allocation; when the last one dies the
    allocation is freed with tw_mem_free, which is collective too: ranks must drop their
    symmetric tensors in the same order, which they do when they run the same program. A
    free synchronises the device (once every rank of the process freed it), so keep
    symmetric tensors long-lived; frees of tensors that die during a CUDA graph capture are
    deferred to the next alloc or close. comm.close() frees whatever is still alive.
    """
    dtype = torch.bfloat16 if dtype is None else dtype
    if not isinstance(dtype, torch.dtype):
        raise TypeError("dtype: expected a torch.dtype, got %r" % (dtype,))
    if dtype not in _DLPACK_DTYPES:
        raise TypeError(
            "dtype: %s is not supported for symmetric tensors (supported: %s)"
            % (dtype, ", ".join(str(d) for d in _DLPACK_DTYPES))
        )
    shape = _shape(shape)
    code, bits = _DLPACK_DTYPES[dtype]
    nbytes = math.prod(shape) * (bits // 8)
    # Every rank asks for the same size, so a zero-size tensor still takes a small slot.
    ptr = comm.alloc(max(nbytes, 16))
    alloc = comm._allocs[ptr]
    capsule, address = _dlpack.export(ptr, shape, code, bits, _dlpack.KDL_CUDA, comm.device,
                                      on_release=alloc.release)
    try:
        return torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        _dlpack.release(address)
        raise


def symmetric_empty(comms, shape, dtype=None):
    """comm.empty(shape, dtype) for each comm of a virtual-rank group, in rank order (one
    thread makes the collective allocation for every rank)."""
    return [c.empty(shape, dtype) for c in comms]


def is_symmetric(comm, t):
    """True when tensor t lies inside a live symmetric allocation of comm."""
    nbytes = t.numel() * t.element_size()
    return comm.find_allocation(t.data_ptr(), max(nbytes, 1)) is not None


def for_each_rank(comms, fn):
    """Calls fn(comm) for each virtual rank on the rank's own stream, forked from and joined
    back into the current stream, so the ranks' kernels (which wait on each other) run
    concurrently. Returns fn's results in rank order. Works under CUDA graph capture.

        tilewire.for_each_rank(comms, lambda c: tilewire.allgather(c, xs[c.rank], outs[c.rank]))
    """
    for c in comms:
        if not isinstance(c, Comm) or not c.virtual:
            raise TypeError("for_each_rank: expected the virtual-rank Comms of init_virtual, "
                            "got %r" % (c,))
    current = torch.cuda.current_stream()
    for c in comms:
        c.stream.wait_stream(current)
    results = []
    for c in comms:
        with torch.cuda.stream(c.stream):
            results.append(fn(c))
    for c in comms:
        current.wait_stream(c.stream)
    return results


# ---- init under torchrun ------------------------------------------------------------------

_init_calls = itertools.count()


def _env_int(name, default=None):
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError("environment %s=%r is not an integer" % (name, value)) from None


class _Waiting:
    """Names what a rank was waiting for when the store's bounded wait gives up (a rank that
    failed or never called init), instead of torch's bare store timeout."""

    def __init__(self, what, rank, world, timeout):
        self.what, self.rank, self.world, self.timeout = what, rank, world, timeout

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is not None and issubclass(kind, (RuntimeError, TimeoutError)):
            raise RuntimeError(
                "tilewire.init: rank %d of %d gave up after %s waiting for %s (did a rank fail "
                "before calling tilewire.init, or call it fewer times?): %s"
                % (self.rank, self.world, self.timeout, self.what, exc)) from exc
        return False


def _store_exchange(store, key, uid, rank, world, timeout):
    if rank == 0:
        store.set(key, uid)
        return uid
    with _Waiting("rank 0's unique id (store key %s)" % key, rank, world, timeout):
        store.wait([key], timeout)
    return bytes(store.get(key))


def _share_unique_id(uid, rank, world, group, store, timeout):
    """Hands rank 0's unique id to every rank."""
    import torch.distributed as dist

    key = "tilewire/unique_id/%d" % next(_init_calls)
    if store is not None:
        return _store_exchange(store, key, uid, rank, world, timeout)
    if dist.is_available() and dist.is_initialized():
        objects = [uid if rank == 0 else None]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(objects, src=src, group=group)
        return objects[0]
    addr, port = os.environ.get("MASTER_ADDR"), _env_int("MASTER_PORT")
    if not addr or port is None:
        raise RuntimeError(
            "tilewire.init: rank %d of %d (RANK/WORLD_SIZE) has no way to receive the unique "
            "id: initialise torch.distributed first, set MASTER_ADDR and MASTER_PORT (torchrun "
            "does), or pass store=" % (rank, world)
        )
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent hosts a store at MASTER_ADDR:MASTER_PORT: join it as a client.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        with _Waiting("torchrun's store at %s:%d" % (addr, port), rank, world, timeout):
            base = dist.TCPStore(addr, port, None, False, timeout)
        prefixed = dist.PrefixStore("tilewire/attempt_%s" % attempt, base)
        return _store_exchange(prefixed, key, uid, rank, world, timeout)
    # No store to join: rank 0 hosts one for the exchange and keeps it until every rank has
    # read the id, then closes it so the port is free for a later init_process_group.
    what = ("the other ranks to join its store at %s:%d" % (addr, port) if rank == 0 else
            "rank 0's store at %s:%d" % (addr, port))
    with _Waiting(what, rank, world, timeout):
        tcp = dist.TCPStore(addr, port, world, rank == 0, timeout)
    try:
        uid = _store_exchange(tcp, key, uid, rank, world, timeout)
        if tcp.add(key + "/read", 1) == world:
            tcp.set(key + "/done", b"1")
        if rank == 0:
            with _Waiting("every rank to read the unique id", rank, world, timeout):
                tcp.wait([key + "/done"], timeout)
    finally:
        del tcp
    return uid


def init(*, group=None, store=None, device=None, config=None, sm_budget=None,
         timeout=datetime.timedelta(seconds=300)):
    """Joins this process's rank of a multi-process tilewire comm (tw_comm_init_rank).

    Rank and world come from torch.distributed's `group` (default: the world) when it is
    initialised, else from the environment (RANK, WORLD_SIZE; 0 and 1 when absent). The
    device is `device`, else LOCAL_RANK modulo the visible GPUs, else torch's current
    device; it is made current. Rank 0 makes the unique id and hands it over `store` when
    given, else with torch.distributed.broadcast_object_list over `group`, else through a
    TCP store at MASTER_ADDR:MASTER_PORT (torchrun's own store when it shares it). Every
    rank of the group must call init, the same number of times.
    """
    import torch.distributed as dist

    dist_ready = dist.is_available() and dist.is_initialized()
    if dist_ready:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    else:
        rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    if not 0 <= rank < world:
        raise ValueError("tilewire.init: rank %d is outside [0, world=%d)" % (rank, world))
    if device is None and torch.cuda.is_available():
        local_rank = _env_int("LOCAL_RANK")
        if local_rank is not None:
            device = local_rank % torch.cuda.device_count()
        else:
            device = torch.cuda.current_device()
    if device is not None:
        torch.cuda.set_device(_comm._device_index(device))
    uid = _comm.get_unique_id() if rank == 0 else None
    if world > 1:
        uid = _share_unique_id(uid, rank, world, group, store, timeout)
    return _comm.init_rank(world, rank, uid, config, sm_budget=sm_budget)


# ---- argument checks (metadata only: they also run on torch.compile's fake tensors) --------


def _check_tensor(t, name, op):
    if not isinstance(t, torch.Tensor):
        raise TypeError("%s: %s must be a torch.Tensor, got %s" % (op, name, type(t).__name__))


def _check_dtype(t, name, op, allowed):
    if t.dtype not in allowed:
        raise TypeError(
            "%s: %s must be %s, got %s"
            % (op, name, " or ".join(str(d) for d in allowed), t.dtype)
        )


def _check_cuda(t, name, op, device):
    """t must be a CUDA tensor on `device` (a torch.device, or None: any CUDA device)."""
    if t.device.type != "cuda":
        raise ValueError("%s: %s is on %s; tilewire needs CUDA tensors" % (op, name, t.device))
    if device is not None and t.device != device:
        raise ValueError("%s: %s is on %s, expected %s" % (op, name, t.device, device))


def _leading_dim(t, name, op):
    """The leading dimension (row stride, elements) of a 2-D row-major matrix, checked
    against tilewire's contract: unit stride along rows, rows 16-byte aligned."""
    rows, cols = t.shape
    if rows == 0 or cols == 0:
        return max(cols, 1)  # nothing is read or written through it
    strides = tuple(t.stride())
    if cols > 1 and strides[1] != 1:
        raise ValueError(
            "%s: %s must be row-major with unit stride along its last dimension, got strides "
            "%s; pass %s.contiguous()" % (op, name, strides, name)
        )
    ld = strides[0] if rows > 1 else cols
    align = 16 // t.element_size()
    if ld < cols or ld % align:
        raise ValueError(
            "%s: %s's row stride is %d elements; it must be >= %d (its columns) and a multiple "
            "of %d (16 bytes); pass %s.contiguous()" % (op, name, ld, cols, align, name)
        )
    return ld


def _check_aligned(t, name, op):
    """Real tensors only (at launch): the data pointer must be 16-byte aligned."""
    if t.numel() and t.data_ptr() % 16:
        raise ValueError(
            "%s: %s's data pointer %#x is not 16-byte aligned (a view at an odd offset?); "
            "pass %s.clone()" % (op, name, t.data_ptr(), name)
        )


# ---- op: gemm -----------------------------------------------------------------------------

_GEMM_OUT_DTYPES = (torch.bfloat16, torch.float32)


def _check_operands(op, a, b, rows, computes):
    """The bf16 operands every GEMM-based op takes: a [rows, K] and b [N, K], K and N multiples
    of 8. `computes` says what the op does with them (for the K-mismatch message). Returns
    (rows, K, N)."""
    for t, name in ((a, "a"), (b, "b")):
        _check_tensor(t, name, op)
        _check_dtype(t, name, op, (torch.bfloat16,))
    if a.dim() != 2:
        raise ValueError("%s: a must be 2-D [%s, K], got shape %s" % (op, rows, tuple(a.shape)))
    if b.dim() != 2:
        raise ValueError("%s: b must be 2-D [N, K], got shape %s" % (op, tuple(b.shape)))
    m, k = a.shape
    n, kb = b.shape
    if kb != k:
        raise ValueError(
            "%s: a is [%s=%d, K=%d] and b is [N=%d, K=%d]: their K differ (%s with b as [N, K])"
            % (op, rows, m, k, n, kb, computes)
        )
    if k % 8:
        raise ValueError("%s: K=%d (a.shape[1]) must be a multiple of 8" % (op, k))
    if n % 8:
        raise ValueError("%s: N=%d (b.shape[0]) must be a multiple of 8" % (op, n))
    return m, k, n


def _check_gemm(a, b, out, out_dtype, sm_count, split_k=0):
    op = "tilewire.gemm"
    m, k, n = _check_operands(op, a, b, "M", "gemm computes a @ b.T")
    if out_dtype is not None:
        if not isinstance(out_dtype, torch.dtype) or out_dtype not in _GEMM_OUT_DTYPES:
            raise TypeError(
                "%s: out_dtype must be torch.bfloat16 or torch.float32, got %r" % (op, out_dtype)
            )
    if isinstance(sm_count, bool) or not isinstance(sm_count, int):
        raise TypeError("%s: sm_count must be an int, got %r" % (op, sm_count))
    if sm_count < 0:
        raise ValueError("%s: sm_count must be >= 0 (0: every SM), got %d" % (op, sm_count))
    if isinstance(split_k, bool) or not isinstance(split_k, int):
        raise TypeError("%s: split_k must be an int, got %r" % (op, split_k))
    if split_k not in (-1, 0, 1, 2, 4, 8):
        raise ValueError("%s: split_k must be 0 or 1 (none), 2, 4, 8, or -1 (the library "
                         "chooses), got %d" % (op, split_k))
    _leading_dim(a, "a", op)
    _leading_dim(b, "b", op)
    dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out is not None:
        _check_tensor(out, "out", op)
        _check_dtype(out, "out", op, _GEMM_OUT_DTYPES)
        if out_dtype is not None and out.dtype != out_dtype:
            raise TypeError("%s: out is %s but out_dtype is %s" % (op, out.dtype, out_dtype))
        if out.dim() != 2 or tuple(out.shape) != (m, n):
            raise ValueError(
                "%s: out must be [M=%d, N=%d], got shape %s" % (op, m, n, tuple(out.shape))
            )
        _leading_dim(out, "out", op)
        dtype = out.dtype
    # Devices last, so that the checks above also run on CPU and meta tensors.
    _check_cuda(a, "a", op, None)
    _check_cuda(b, "b", op, a.device)
    if out is not None:
        _check_cuda(out, "out", op, a.device)
    return dtype


_gemm_ws = {}  # (device index, cudaStream_t) -> tw_gemm's split-K workspace on that stream


def _gemm_workspace(device, stream):
    """tw_gemm's workspace for split_k -1 on `stream` (tw_gemm_args_t.workspace: the K slices
    of a decode product then run as single CTAs, twice the cluster tree's, with the same bits):
    TW_GEMM_WORKSPACE_BYTES zeroed once on that stream and kept, one per stream so that calls
    on different streams never share one. None while that stream captures a CUDA graph and has
    none yet, or once 64 streams hold one (tw_gemm then sums through a cluster: the same
    bits)."""
    key = (device.index, stream.value)
    ws = _gemm_ws.get(key)
    if ws is None:
        if torch.cuda.is_current_stream_capturing() or len(_gemm_ws) >= 64:
            return None
        ws = torch.zeros(_lib.TW_GEMM_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        _gemm_ws[key] = ws
    return ws


def _launch_gemm(a, b, out, sm_count, split_k=0):
    """Launches tw_gemm; returns its args struct (None where nothing was launched)."""
    m, k = a.shape
    n = b.shape[0]
    if m == 0 or n == 0:
        return None
    if k == 0:
        out.zero_()
        return None
    op = "tilewire.gemm"
    _check_aligned(a, "a", op)
    _check_aligned(b, "b", op)
    _check_aligned(out, "out", op)
    stream = _stream(a.device)
    with _on_device(a.device.index):  # the capture check below reads the current device
        ws = _gemm_workspace(a.device, stream) if split_k == -1 else None
        args = _lib.GemmArgs(
            c_dtype=_lib.DType.BF16 if out.dtype == torch.bfloat16 else _lib.DType.FP32,
            a=a.data_ptr(), b=b.data_ptr(), c=out.data_ptr(), m=m, n=n, k=k,
            lda=_leading_dim(a, "a", op), ldb=_leading_dim(b, "b", op),
            ldc=_leading_dim(out, "out", op), sm_count=sm_count, split_k=split_k,
            workspace=ws.data_ptr() if ws is not None else None,
            workspace_bytes=ws.numel() if ws is not None else 0,
        )
        _lib.call("tw_gemm", ctypes.byref(args), stream)
    return args


@_custom_op("tilewire::gemm")
def _gemm_op(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, sm_count: int,
             split_k: int = 0) -> torch.Tensor:
    out = torch.empty((a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device)
    _launch_gemm(a, b, out, sm_count, split_k)
    return out


@_register_fake(_gemm_op)
def _gemm_fake(a, b, out_dtype, sm_count, split_k=0):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def _gemm_lane(hit, a, b, out, split_k):
    """A fast-lane hit of tilewire.gemm: out (allocated here when None), or None where the call
    must go the whole way."""
    tmpl, dtype = hit
    if not _direct_ok((a, b, out), () if out is None else (out,)) \
            or a.device.index != _current_device():
        return None
    stream = _stream(a.device)
    ws = None
    if split_k == -1:
        ws = _gemm_ws.get((a.device.index, stream.value))
        if ws is None:
            return None
    given = out is not None
    if not given:
        out = torch.empty((a.shape[0], b.shape[0]), dtype=dtype, device=a.device)
    pa, pb, pc = a.data_ptr(), b.data_ptr(), out.data_ptr()
    if (pa | pb | pc) & 15:
        return None
    args = _lane_args(tmpl)
    args.a, args.b, args.c = pa, pb, pc
    if ws is not None:
        args.workspace, args.workspace_bytes = ws.data_ptr(), ws.numel()
    if given:
        _mutated((out,))
    _lib.call("tw_gemm", ctypes.byref(args), stream)
    return out


@_custom_op("tilewire::gemm_out", mutates_args=("out",))
def _gemm_out_op(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, sm_count: int,
                 split_k: int = 0) -> None:
    _launch_gemm(a, b, out, sm_count, split_k)


@_register_fake(_gemm_out_op)
def _gemm_out_fake(a, b, out, sm_count, split_k=0):
    return None


if _HAVE_CUSTOM_OP and hasattr(_gemm_op, "register_autograd"):

    def _gemm_setup_context(ctx, inputs, output):
        a, b, _, _, _ = inputs
        ctx.save_for_backward(a, b)

    def _gemm_backward(ctx, grad):
        # Backward with torch's matmul: d(a @ b.T)/da = grad @ b, /db = grad.T @ a.
        a, b = ctx.saved_tensors
        grad = grad.to(a.dtype)
        return grad @ b, grad.t() @ a, None, None, None

    _gemm_op.register_autograd(_gemm_backward, setup_context=_gemm_setup_context)


def gemm(a, b, out=None, out_dtype=None, sm_count=0, split_k=0):
    """``a @ b.T`` with tilewire's Hopper GEMM (tw_gemm): a [M, K] and b [N, K] bfloat16,
    fp32 accumulation, output [M, N] in `out_dtype` (torch.bfloat16, the default, or
    torch.float32; with `out`, its dtype). K and N multiples of 8; rows may be strided
    (row stride a multiple of 8 elements). sm_count: SMs to use (0: all). split_k: K slices
    per output tile (tw_gemm_args_t.split_k): 0 or 1 none (the default, the unsplit bits), 2, 4
    or 8, or -1 to let the library split few tiles over a long K (decode shapes) by the shape
    alone; a split sums the slices in a fixed order (the same bits on every run, not the unsplit
    ones). With -1 a workspace per stream (9 MiB, kept) lets the slices run on twice the CTAs,
    with the same bits. Runs on torch's current CUDA stream; CUDA-graph capturable; traceable by
    torch.compile (torch.ops.tilewire.gemm / gemm_out).
    """
    key = None
    if _lane_open(a, b, out):
        key, hit = _lane_find("gemm", _meta(a), _meta(b), _meta(out), out_dtype, sm_count,
                              type(sm_count), split_k, type(split_k))
        if hit is not None:
            done = _gemm_lane(hit, a, b, out, split_k)
            if done is not None:
                return done
    dtype = _check_gemm(a, b, out, out_dtype, sm_count, split_k)
    if out is not None:
        args = _call_mutating(lambda *x: torch.ops.tilewire.gemm_out(*x), _launch_gemm,
                              (a, b, out), (out,), a, b, out, sm_count, split_k)
        _lane_put(key, (args, dtype))
        return out
    if _direct_ok((a, b), ()):
        out = torch.empty((a.shape[0], b.shape[0]), dtype=dtype, device=a.device)
        _lane_put(key, (_launch_gemm(a, b, out, sm_count, split_k), dtype))
        return out
    if _HAVE_CUSTOM_OP:
        return torch.ops.tilewire.gemm(a, b, dtype, sm_count, split_k)
    return _gemm_op(a, b, dtype, sm_count, split_k)


# ---- op: allgather ------------------------------------------------------------------------


def _check_comm(comm, op):
    if not isinstance(comm, Comm):
        raise TypeError("%s: comm must be a tilewire.Comm, got %s" % (op, type(comm).__name__))
    if comm.closed:
        raise ValueError("%s: comm is closed" % op)


def _check_allgather(comm, x, out):
    op = "tilewire.allgather"
    _check_comm(comm, op)
    _check_tensor(x, "x", op)
    _check_tensor(out, "out", op)
    if out.dtype != x.dtype:
        raise TypeError("%s: out is %s but x is %s" % (op, out.dtype, x.dtype))
    if not x.is_contiguous():
        raise ValueError("%s: x must be contiguous; pass x.contiguous()" % op)
    if not out.is_contiguous():
        raise ValueError("%s: out must be contiguous (a tensor from comm.empty)" % op)
    nbytes = x.numel() * x.element_size()
    if nbytes == 0 or nbytes % 16:
        raise ValueError(
            "%s: x has %d bytes; it must be a positive multiple of 16" % (op, nbytes)
        )
    if out.numel() != comm.size * x.numel():
        raise ValueError(
            "%s: out has %d elements; it must have world * x.numel() = %d * %d = %d"
            % (op, out.numel(), comm.size, x.numel(), comm.size * x.numel())
        )
    device = torch.device("cuda", comm.device)
    _check_cuda(x, "x", op, device)
    _check_cuda(out, "out", op, device)


def _allgather_impl(comm_id, x, out):
    op = "tilewire.allgather"
    comm = comm_by_id(comm_id)
    _check_aligned(x, "x", op)
    _check_aligned(out, "out", op)
    if not is_symmetric(comm, out):
        raise ValueError(
            "%s: out must be a symmetric tensor of rank %d's comm (from comm.empty), but its "
            "memory is not a live tw_mem_alloc allocation of that comm" % (op, comm.rank)
        )
    nbytes = x.numel() * x.element_size()
    _lib.call("tw_allgather", comm.handle, ctypes.c_void_p(x.data_ptr()),
              ctypes.c_void_p(out.data_ptr()), ctypes.c_size_t(nbytes), _stream(x.device))


@_custom_op("tilewire::allgather", mutates_args=("out",))
def _allgather_op(comm_id: int, x: torch.Tensor, out: torch.Tensor) -> None:
    _allgather_impl(comm_id, x, out)


@_register_fake(_allgather_op)
def _allgather_fake(comm_id, x, out):
    return None


def allgather(comm, x, out):
    """AllGather (tw_allgather): every rank's `x` lands in `out` at offset rank * x.numel()
    (like torch.cat(xs) flattened). `out` must be a symmetric tensor from comm.empty with
    world * x.numel() elements and x's dtype; x holds a multiple of 16 bytes, contiguous
    (it may be this rank's slice of out). Runs on the current stream; with virtual ranks,
    use a stream per rank (for_each_rank). Returns out.
    """
    _check_allgather(comm, x, out)
    _call_mutating(lambda *x: torch.ops.tilewire.allgather(*x), _allgather_impl, (x, out),
                   (out,), comm.id, x, out)
    return out


# ---- barrier (eager only: an op with no tensor would be dropped from a traced graph) ------


def barrier(comm):
    """A device-side barrier across the comm's ranks (tw_barrier), in stream order on the
    current stream. Not registered as a custom op: call it outside torch.compile regions."""
    _check_comm(comm, "tilewire.barrier")
    _lib.call("tw_barrier", comm.handle, _stream(torch.device("cuda", comm.device)))


# ---- fused op: ag_gemm --------------------------------------------------------------------
#
# A fused op is one mutating custom op (the output is allocated by the public function, so
# the op needs no functional twin) plus its validating function. Template for the next ones.


def _check_ag_gemm(comm, a, b, a_gathered, out, out_dtype, comm_sms, gathered_out=True):
    op = "tilewire.ag_gemm"
    _check_comm(comm, op)
    if not isinstance(gathered_out, bool):
        raise TypeError("%s: gathered_out must be a bool, got %r" % (op, gathered_out))
    m_local, k, n = _check_operands(op, a, b, "m_local", "ag_gemm computes gather(a) @ b.T")
    _check_tensor(a_gathered, "a_gathered", op)
    _check_dtype(a_gathered, "a_gathered", op, (torch.bfloat16,))
    if m_local < 1:
        raise ValueError("%s: a must have at least one row, got shape %s" % (op, tuple(a.shape)))
    if not a.is_contiguous():
        raise ValueError("%s: a must be contiguous (packed rows); pass a.contiguous()" % op)
    _leading_dim(b, "b", op)
    world = comm.size
    if not a_gathered.is_contiguous() or a_gathered.numel() < world * m_local * k:
        raise ValueError(
            "%s: a_gathered must be a contiguous symmetric tensor (comm.empty) of at least "
            "world * m_local * K = %d * %d * %d elements, got shape %s"
            % (op, world, m_local, k, tuple(a_gathered.shape))
        )
    if out_dtype is not None and out_dtype not in _GEMM_OUT_DTYPES:
        raise TypeError(
            "%s: out_dtype must be torch.bfloat16 or torch.float32, got %r" % (op, out_dtype)
        )
    if isinstance(comm_sms, bool) or not isinstance(comm_sms, int) or comm_sms < 0:
        raise ValueError("%s: comm_sms must be an int >= 0 (0: heuristic), got %r"
                         % (op, comm_sms))
    dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out is not None:
        _check_tensor(out, "out", op)
        _check_dtype(out, "out", op, _GEMM_OUT_DTYPES)
        if out_dtype is not None and out.dtype != out_dtype:
            raise TypeError("%s: out is %s but out_dtype is %s" % (op, out.dtype, out_dtype))
        if out.dim() != 2 or tuple(out.shape) != (world * m_local, n):
            raise ValueError(
                "%s: out must be [world * m_local=%d, N=%d], got shape %s"
                % (op, world * m_local, n, tuple(out.shape))
            )
        _leading_dim(out, "out", op)
        dtype = out.dtype
    device = torch.device("cuda", comm.device)
    for t, name in ((a, "a"), (b, "b"), (a_gathered, "a_gathered"), (out, "out")):
        if t is not None:
            _check_cuda(t, name, op, device)
    return dtype


def _ag_gemm_impl(comm_id, a, b, a_gathered, out, comm_sms, no_gathered_out):
    op = "tilewire.ag_gemm"
    comm = comm_by_id(comm_id)
    for t, name in ((a, "a"), (b, "b"), (a_gathered, "a_gathered"), (out, "out")):
        _check_aligned(t, name, op)
    if not is_symmetric(comm, a_gathered):
        raise ValueError(
            "%s: a_gathered must be a symmetric tensor of rank %d's comm (from comm.empty)"
            % (op, comm.rank)
        )
    m_local, k = a.shape
    args = _lib.AgGemmArgs(
        c_dtype=_lib.DType.BF16 if out.dtype == torch.bfloat16 else _lib.DType.FP32,
        a=a.data_ptr(), b=b.data_ptr(), c=out.data_ptr(), a_gathered=a_gathered.data_ptr(),
        m_local=m_local, n=b.shape[0], k=k, ldb=_leading_dim(b, "b", op),
        ldc=_leading_dim(out, "out", op), comm_sms=comm_sms, no_gathered_out=no_gathered_out,
    )
    _lib.call("tw_ag_gemm", comm.handle, ctypes.byref(args), _stream(a.device))
    return args


@_custom_op("tilewire::ag_gemm", mutates_args=("a_gathered", "out"))
def _ag_gemm_op(comm_id: int, a: torch.Tensor, b: torch.Tensor, a_gathered: torch.Tensor,
                out: torch.Tensor, comm_sms: int, no_gathered_out: int) -> None:
    _ag_gemm_impl(comm_id, a, b, a_gathered, out, comm_sms, no_gathered_out)


@_register_fake(_ag_gemm_op)
def _ag_gemm_fake(comm_id, a, b, a_gathered, out, comm_sms, no_gathered_out):
    return None


def _ag_gemm_run(comm_id, a, b, a_gathered, out, comm_sms, no_gather):
    """The launch (the autograd Function's forward calls it too). Returns the args struct
    where it ran directly (the fast lane's), else None."""
    return _call_mutating(lambda *x: torch.ops.tilewire.ag_gemm(*x), _ag_gemm_impl,
                          (a, b, a_gathered, out), (a_gathered, out),
                          comm_id, a, b, a_gathered, out, comm_sms, no_gather)


def _ag_gemm_lane(hit, comm, a, b, a_gathered, out):
    """A fast-lane hit of tilewire.ag_gemm: out, or None where the call must go the whole
    way."""
    tmpl, dtype, rows, n = hit
    if comm.closed or not _direct_ok((a, b, a_gathered, out), (a_gathered,)
                                     if out is None else (a_gathered, out)):
        return None
    if out is None:
        out = torch.empty((rows, n), dtype=dtype, device=a.device)
    pa, pb, pc = a.data_ptr(), b.data_ptr(), out.data_ptr()
    if (pa | pb | pc) & 15:
        return None
    args = _lane_args(tmpl)
    args.a, args.b, args.c = pa, pb, pc
    _mutated((a_gathered, out))
    _lib.call("tw_ag_gemm", comm.handle, ctypes.byref(args), _stream(a.device))
    return out


def ag_gemm(comm, a, b, a_gathered, out=None, out_dtype=None, comm_sms=0, gathered_out=True,
            grad_workspace=None):
    """Fused AllGather + GEMM (tw_ag_gemm), the column-parallel linear layer:
    ``out = torch.cat([a of every rank]) @ b.T``, [world * m_local, N].

    a: this rank's [m_local, K] bf16 shard, contiguous (it may be its slice of
    a_gathered: then nothing is copied for it); b: [N, K] bf16; a_gathered: a symmetric
    bf16 tensor (comm.empty) of at least world * m_local * K elements, holding the gathered
    a afterwards (the backward pass needs it); out_dtype torch.bfloat16 (default) or
    torch.float32; comm_sms: CTAs that push data before joining the GEMM (0: heuristic);
    gathered_out=False: a_gathered need not hold the gathered a afterwards (only this
    rank's slice), which lets ranks sharing one GPU read each other's shards in place
    (tilewire.h, no_gathered_out). Collective: every rank calls it with the same shapes and
    the same gathered_out. Returns out.

    Differentiable (autograd records it when a or b requires grad): the backward is the
    row-parallel pair, a's gradient = gemm_rs(comm, grad_out, b.T) (the reduce-scatter of
    grad_out @ b over ranks, into grad_workspace: tilewire.gemm_rs_workspace(comm, world *
    m_local, K), needed when a requires grad) and b's = grad_out.T @ gathered a (torch.matmul
    on a_gathered, which must then keep the gathered a until the backward: gathered_out=True,
    and no other call writing a_gathered in between, or autograd reports it modified).
    Collective in the backward too: every rank runs it.
    """
    key = None
    if type(comm) is Comm and _lane_open(a, b, a_gathered, out):
        key, hit = _lane_find("ag_gemm", comm.id, comm.alloc_generation, _meta(a), _meta(b),
                              _meta(a_gathered), a_gathered.data_ptr(), _meta(out), out_dtype,
                              comm_sms, type(comm_sms), gathered_out, type(gathered_out))
        if hit is not None:
            done = _ag_gemm_lane(hit, comm, a, b, a_gathered, out)
            if done is not None:
                return done
    dtype = _check_ag_gemm(comm, a, b, a_gathered, out, out_dtype, comm_sms, gathered_out)
    if out is None:
        out = torch.empty((comm.size * a.shape[0], b.shape[0]), dtype=dtype, device=a.device)
    no_gather = 0 if gathered_out else 1
    if _records_grad(a, b):
        _check_ag_gemm_grad(comm, a, b, a_gathered, out, gathered_out, grad_workspace)
        return _AgGemmFunction.apply(comm.id, a, b, a_gathered, out, comm_sms, no_gather,
                                     grad_workspace)
    args = _ag_gemm_run(comm.id, a, b, a_gathered, out, comm_sms, no_gather)
    _lane_put(key, (args, dtype, out.shape[0], out.shape[1]))
    return out


# ---- fused ops: gemm_rs and gemm_ar (one args struct, one check, two custom ops) ----------


def gemm_rs_workspace(comm, m, n):
    """The symmetric workspace tw_gemm_rs / tw_gemm_ar need for an m x n product on comm: a
    uint8 tensor from comm.empty (collective). Allocate it once and reuse it."""
    return comm.empty((max(comm.gemm_rs_workspace_size(m, n), 1),), torch.uint8)


# tw_partials_t: the precision partial products travel in (the sum is fp32 either way).
_PARTIALS = {"fp32": _lib.Partials.FP32, "bf16": _lib.Partials.BF16}


def _check_gemm_reduce(op, comm, a, b, workspace, out, reduce_sms, partials, scatter):
    _check_comm(comm, op)
    m, k, n = _check_operands(op, a, b, "M", "the op sums a @ b.T over ranks")
    world = comm.size
    if m < world or m % world:
        raise ValueError("%s: M=%d (a.shape[0]) must be a positive multiple of world=%d"
                         % (op, m, world))
    _leading_dim(a, "a", op)
    _leading_dim(b, "b", op)
    if workspace is None:
        if world > 1:
            raise ValueError("%s: workspace is needed when world > 1 "
                             "(tilewire.gemm_rs_workspace(comm, M, N))" % op)
    else:
        _check_tensor(workspace, "workspace", op)
        if not workspace.is_contiguous():
            raise ValueError("%s: workspace must be contiguous (from comm.empty)" % op)
    if isinstance(reduce_sms, bool) or not isinstance(reduce_sms, int) or reduce_sms < 0:
        raise ValueError("%s: reduce_sms must be an int >= 0 (0: heuristic), got %r"
                         % (op, reduce_sms))
    if partials not in _PARTIALS:
        raise ValueError("%s: partials must be 'fp32' or 'bf16', got %r" % (op, partials))
    rows = m // world if scatter else m
    if out is not None:
        _check_tensor(out, "out", op)
        _check_dtype(out, "out", op, (torch.bfloat16,))
        if out.dim() != 2 or tuple(out.shape) != (rows, n):
            raise ValueError("%s: out must be [%s=%d, N=%d], got shape %s"
                             % (op, "M / world" if scatter else "M", rows, n,
                                tuple(out.shape)))
        _leading_dim(out, "out", op)
    device = torch.device("cuda", comm.device)
    for t, name in ((a, "a"), (b, "b"), (workspace, "workspace"), (out, "out")):
        if t is not None:
            _check_cuda(t, name, op, device)
    return rows, n


def _launch_gemm_reduce(function, comm_id, a, b, workspace, out, reduce_sms, partials,
                        out_symmetric=0):
    op = "tilewire." + function[3:]
    comm = comm_by_id(comm_id)
    for t, name in ((a, "a"), (b, "b"), (out, "out")):
        _check_aligned(t, name, op)
    m, k = a.shape
    n = b.shape[0]
    workspace_ptr = None
    if workspace.numel():
        _check_aligned(workspace, "workspace", op)
        need = comm.gemm_rs_workspace_size(m, n)
        have = workspace.numel() * workspace.element_size()
        if not is_symmetric(comm, workspace) or have < need:
            raise ValueError(
                "%s: workspace must be a symmetric tensor of rank %d's comm with at least "
                "%d bytes (tilewire.gemm_rs_workspace(comm, %d, %d)); got %d bytes%s"
                % (op, comm.rank, need, m, n, have,
                   "" if is_symmetric(comm, workspace) else ", not symmetric")
            )
        workspace_ptr = workspace.data_ptr()
    args = _lib.GemmRsArgs(
        out_dtype=_lib.DType.BF16, a=a.data_ptr(), b=b.data_ptr(), out=out.data_ptr(),
        workspace=workspace_ptr, m=m, n=n, k=k, lda=_leading_dim(a, "a", op),
        ldb=_leading_dim(b, "b", op), ldo=_leading_dim(out, "out", op), reduce_sms=reduce_sms,
        partials=partials, out_symmetric=out_symmetric,
    )
    _lib.call(function, comm.handle, ctypes.byref(args), _stream(a.device))
    return args


def _gemm_rs_impl(comm_id, a, b, workspace, out, reduce_sms, partials):
    return _launch_gemm_reduce("tw_gemm_rs", comm_id, a, b, workspace, out, reduce_sms,
                               partials)


def _gemm_ar_impl(comm_id, a, b, workspace, out, reduce_sms, partials, out_symmetric):
    return _launch_gemm_reduce("tw_gemm_ar", comm_id, a, b, workspace, out, reduce_sms,
                               partials, out_symmetric)


@_custom_op("tilewire::gemm_rs", mutates_args=("workspace", "out"))
def _gemm_rs_op(comm_id: int, a: torch.Tensor, b: torch.Tensor, workspace: torch.Tensor,
                out: torch.Tensor, reduce_sms: int, partials: int) -> None:
    _gemm_rs_impl(comm_id, a, b, workspace, out, reduce_sms, partials)


@_register_fake(_gemm_rs_op)
def _gemm_rs_fake(comm_id, a, b, workspace, out, reduce_sms, partials):
    return None


@_custom_op("tilewire::gemm_ar", mutates_args=("workspace", "out"))
def _gemm_ar_op(comm_id: int, a: torch.Tensor, b: torch.Tensor, workspace: torch.Tensor,
                out: torch.Tensor, reduce_sms: int, partials: int, out_symmetric: int) -> None:
    _gemm_ar_impl(comm_id, a, b, workspace, out, reduce_sms, partials, out_symmetric)


@_register_fake(_gemm_ar_op)
def _gemm_ar_fake(comm_id, a, b, workspace, out, reduce_sms, partials, out_symmetric):
    return None


def _reduce_lane(hit, comm, a, b, workspace, out):
    """A fast-lane hit of tilewire.gemm_rs / gemm_ar: out, or None where the call must go the
    whole way."""
    tmpl, function, rows, n = hit
    if comm.closed or not _direct_ok((a, b, workspace, out),
                                     tuple(t for t in (workspace, out) if t is not None)):
        return None
    if out is None:
        out = torch.empty((rows, n), dtype=torch.bfloat16, device=a.device)
    pa, pb, po = a.data_ptr(), b.data_ptr(), out.data_ptr()
    if (pa | pb | po) & 15:
        return None
    args = _lane_args(tmpl)
    args.a, args.b, args.out = pa, pb, po
    _mutated((out,) if workspace is None else (workspace, out))
    _lib.call(function, comm.handle, ctypes.byref(args), _stream(a.device))
    return out


def _gemm_reduce(scatter, comm, a, b, workspace, out, reduce_sms, partials, out_symmetric=False):
    op = "tilewire.gemm_rs" if scatter else "tilewire.gemm_ar"
    key = None
    if type(comm) is Comm and _lane_open(a, b, workspace, out):
        sym_out = out.data_ptr() if out_symmetric is True and out is not None else None
        key, hit = _lane_find(op, comm.id, comm.alloc_generation, _meta(a), _meta(b),
                              _meta(workspace),
                              None if workspace is None else workspace.data_ptr(), _meta(out),
                              sym_out, reduce_sms, type(reduce_sms), partials, out_symmetric,
                              type(out_symmetric))
        if hit is not None:
            done = _reduce_lane(hit, comm, a, b, workspace, out)
            if done is not None:
                return done
    rows, n = _check_gemm_reduce(op, comm, a, b, workspace, out, reduce_sms, partials, scatter)
    if not isinstance(out_symmetric, bool):
        raise ValueError("%s: out_symmetric must be a bool, got %r" % (op, out_symmetric))
    if out_symmetric and (out is None or not out.is_contiguous() or not is_symmetric(comm, out)):
        raise ValueError("%s: out_symmetric=True needs out, a contiguous symmetric tensor of "
                         "rank %d's comm (comm.empty((M, N), torch.bfloat16))" % (op, comm.rank))
    if out is None:
        out = torch.empty((rows, n), dtype=torch.bfloat16, device=a.device)
    given_workspace = workspace
    if workspace is None:  # world == 1: the op needs none; the custom op wants a tensor
        workspace = torch.empty(0, dtype=torch.uint8, device=a.device)
    args = (comm.id, a, b, workspace, out, reduce_sms, int(_PARTIALS[partials]),
            int(out_symmetric))
    if _records_grad(a, b):
        if scatter:
            _check_gemm_rs_grad(comm, a, b, given_workspace, out)
        else:
            _check_out_for_grad("tilewire.gemm_ar", out)
        return _GemmReduceFunction.apply(scatter, *args)
    _lane_put(key, (_gemm_reduce_run(scatter, *args), "tw_gemm_rs" if scatter else "tw_gemm_ar",
                    rows, n))
    return out


def _gemm_reduce_run(scatter, comm_id, a, b, workspace, out, reduce_sms, partials, out_symmetric):
    """The launch (the autograd Function's forward calls it too); gemm_rs takes no
    out_symmetric."""
    args = (comm_id, a, b, workspace, out, reduce_sms, partials)
    if scatter:
        return _call_mutating(lambda *x: torch.ops.tilewire.gemm_rs(*x), _gemm_rs_impl,
                              (a, b, workspace, out), (workspace, out), *args)
    return _call_mutating(lambda *x: torch.ops.tilewire.gemm_ar(*x), _gemm_ar_impl,
                          (a, b, workspace, out), (workspace, out), *args, out_symmetric)


def gemm_rs(comm, a, b, workspace, out=None, reduce_sms=0, partials="fp32"):
    """Fused GEMM + ReduceScatter (tw_gemm_rs), the row-parallel linear layer: with
    S = sum over ranks of a @ b.T (fp32 accumulation, rank-ordered, reproducible), this
    rank gets rows [rank * M / world, (rank + 1) * M / world) of S as bf16 [M / world, N].

    a: [M, K] bf16, b: [N, K] bf16 (row strides multiples of 8); M a multiple of world;
    workspace: from tilewire.gemm_rs_workspace(comm, M, N) (None when world == 1);
    reduce_sms: CTAs that start on the reduction (0: heuristic); partials: "fp32" (default)
    or "bf16": each rank's partial product rounded to bf16 before it travels (as the bf16
    output of a plain torch matmul would be), still summed in fp32 in rank order; half the
    bytes, faster on NVLink. Same value on every rank. Collective. Returns out.

    Differentiable (autograd records it when a or b requires grad): the backward is the
    column-parallel pair, all-gathering grad_out [M / world, N] into the workspace (viewed as
    bf16 [M, N]) while computing a's gradient, gathered grad_out @ b (tilewire.ag_gemm), then
    b's = gathered grad_out.T @ a (torch.matmul). Collective in the backward too.
    """
    return _gemm_reduce(True, comm, a, b, workspace, out, reduce_sms, partials)


def gemm_ar(comm, a, b, workspace, out=None, reduce_sms=0, partials="fp32", out_symmetric=False):
    """Fused GEMM + AllReduce (tw_gemm_ar): every rank gets S = sum over ranks of a @ b.T
    as bf16 [M, N]. Arguments as gemm_rs. out_symmetric=True: out is a symmetric tensor
    (comm.empty((M, N), torch.bfloat16), the same allocation on every rank); each rank then
    writes its reduced rows straight into every rank's out, with no gather copy (faster; the
    same value on every rank). Collective. Returns out.

    Differentiable: as in Megatron's row-parallel layer, the all-reduce's backward is the
    identity (every rank's output is the same replicated value and its gradient is taken as
    that rank's own), so a's gradient is grad_out @ b and b's grad_out.T @ a, both local
    (torch.matmul); the backward communicates nothing."""
    return _gemm_reduce(False, comm, a, b, workspace, out, reduce_sms, partials, out_symmetric)


# ---- autograd: the fused ops' backward passes ---------------------------------------------
#
# Tensor parallelism pairs the two fused collectives: the backward of the column-parallel
# AllGather+GEMM is a GEMM+ReduceScatter and the backward of the row-parallel
# GEMM+ReduceScatter an AllGather+GEMM, so each backward runs the other fused op for the
# activation gradient and torch.matmul (cuBLAS handles the transposes) for the weight's.
# The Functions call the launches above (grad mode is off inside them, so eager calls take the
# direct path); their outputs are the ops' `out`, marked dirty.


def _records_grad(a, b):
    return torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)


def _bf16_contiguous(t):
    return (t if t.dtype == torch.bfloat16 else t.to(torch.bfloat16)).contiguous()


def _check_out_for_grad(op, out):
    if out.requires_grad:
        raise ValueError("%s: out requires grad; with autograd, out must be a plain buffer "
                         "(or None)" % op)


def _check_ag_gemm_grad(comm, a, b, a_gathered, out, gathered_out, grad_workspace):
    op = "tilewire.ag_gemm"
    _check_out_for_grad(op, out)
    if b.requires_grad and not gathered_out:
        raise ValueError("%s: b requires grad, whose backward reads the gathered a: pass "
                         "gathered_out=True" % op)
    if a.requires_grad:
        m, k = comm.size * a.shape[0], a.shape[1]
        if grad_workspace is None and comm.size > 1:
            raise ValueError(
                "%s: a requires grad, whose backward is a GEMM+ReduceScatter: pass "
                "grad_workspace=tilewire.gemm_rs_workspace(comm, %d, %d) (allocated once, "
                "collectively, and reused)" % (op, m, k))
        if grad_workspace is not None:
            _check_workspace_size(op, "grad_workspace", comm, grad_workspace, m, k)


def _check_gemm_rs_grad(comm, a, b, workspace, out):
    op = "tilewire.gemm_rs"
    _check_out_for_grad(op, out)
    if comm.size > 1:  # the backward gathers grad_out into the workspace, as bf16 [M, N]
        _check_workspace_size(op, "workspace", comm, workspace, a.shape[0], b.shape[0])


def _check_workspace_size(op, name, comm, ws, m, n):
    need = comm.gemm_rs_workspace_size(m, n)
    have = ws.numel() * ws.element_size()
    if not ws.is_contiguous() or have < need or not is_symmetric(comm, ws):
        raise ValueError("%s: %s must be a contiguous symmetric tensor of at least %d bytes "
                         "(tilewire.gemm_rs_workspace(comm, %d, %d)), got %d bytes%s"
                         % (op, name, need, m, n, have,
                            "" if is_symmetric(comm, ws) else ", not symmetric"))


def _bf16_matrix(ws, rows, cols):
    """The first rows x cols bf16 of a symmetric uint8 workspace, as a matrix view."""
    return ws.view(-1)[:rows * cols * 2].view(torch.bfloat16).view(rows, cols)


class _AgGemmFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm_id, a, b, a_gathered, out, comm_sms, no_gather, grad_workspace):
        _ag_gemm_run(comm_id, a, b, a_gathered, out, comm_sms, no_gather)
        m, k = out.shape[0], a.shape[1]
        ctx.comm_id, ctx.grad_workspace, ctx.m, ctx.k = comm_id, grad_workspace, m, k
        ctx.save_for_backward(b, a_gathered)
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        b, a_gathered = ctx.saved_tensors
        comm = comm_by_id(ctx.comm_id)
        g = _bf16_contiguous(grad_out)
        grad_a = grad_b = None
        if ctx.needs_input_grad[1]:  # the reduce-scatter of g @ b: rows of this rank's shard
            grad_a = gemm_rs(comm, g, b.t().contiguous(), ctx.grad_workspace)
        if ctx.needs_input_grad[2]:
            gathered = a_gathered.reshape(-1)[:ctx.m * ctx.k].view(ctx.m, ctx.k)
            grad_b = torch.matmul(g.t(), gathered)
        return None, grad_a, grad_b, None, None, None, None, None


class _GemmReduceFunction(torch.autograd.Function):
    """gemm_rs (scatter) and gemm_ar; the arguments after `scatter` are _gemm_reduce_run's."""

    @staticmethod
    def forward(ctx, scatter, comm_id, a, b, workspace, out, reduce_sms, partials, out_symmetric):
        _gemm_reduce_run(scatter, comm_id, a, b, workspace, out, reduce_sms, partials,
                         out_symmetric)
        ctx.scatter, ctx.comm_id, ctx.workspace = scatter, comm_id, workspace
        ctx.save_for_backward(a, b)
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        a, b = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        comm = comm_by_id(ctx.comm_id)
        g = _bf16_contiguous(grad_out)  # gemm_rs: [M / world, N]; gemm_ar: [M, N]
        if not ctx.scatter or comm.size == 1:  # nothing to gather (gemm_ar: the identity)
            gathered, grad_a = g, (torch.matmul(g, b) if need_a else None)
        else:  # the workspace is free once the forward ran: it holds the gathered grad_out
            gathered = _bf16_matrix(ctx.workspace, a.shape[0], b.shape[0])
            if need_a:
                grad_a = ag_gemm(comm, g, b.t().contiguous(), gathered)
            else:
                grad_a = None
                allgather(comm, g, gathered)
        grad_b = torch.matmul(gathered.t(), a) if need_b else None
        return None, None, grad_a, grad_b, None, None, None, None, None


# ---- the next ops: add each here as it lands in tilewire.h ---------------------------------
#
# Checklist per op (ag_gemm above is the template): _lib.FUNCTIONS and the args struct in
# _lib.STRUCTS; the struct in python/tools/struct_layout.c; a _check_<op> function, a
# mutating custom op with register_fake, and the public function here; its name in
# __init__._TORCH_NAMES; a GPU test against the torch reference in python/tests/test_gpu.py.
