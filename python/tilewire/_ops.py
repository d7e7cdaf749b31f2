"""The unfused ops of the torch front end: gemm, grouped_gemm, allgather and barrier, and
for_each_rank, which runs a call per virtual rank on the ranks' own streams.

Every op is two pieces: a public function that validates its arguments (_glue's checks) and
calls the op, and a ``torch.library.custom_op`` whose implementation launches on torch's
current CUDA stream (no host synchronisation: CUDA-graph capturable) with a ``register_fake``
that gives torch.compile the output's metadata. In eager mode the public function may call
the implementation directly or by the fast lane (_eager).
"""

import ctypes

import torch

from . import _lib, _moe_grad
from ._comm import Comm, comm_by_id
from ._eager import (
    _call_mutating,
    _direct_ok,
    _lane_args,
    _lane_find,
    _lane_open,
    _lane_put,
    _meta,
    _mutated,
)
from ._glue import (
    _GEMM_OUT_DTYPES,
    _HAVE_CUSTOM_OP,
    _check_aligned,
    _check_comm,
    _check_cuda,
    _check_dtype,
    _check_operands,
    _check_tensor,
    _current_device,
    _custom_op,
    _leading_dim,
    _on_device,
    _register_fake,
    _stream,
)
from ._symmetric import is_symmetric

# ---- virtual ranks ------------------------------------------------------------------------


def for_each_rank(comms, fn):
    """Calls fn(comm) for each virtual rank on the rank's own stream, forked from and joined
    back into the current stream, so the ranks' kernels (which wait on each other) run
    concurrently. Returns fn's results in rank order. Works under CUDA graph capture.

        tilewire.for_each_rank(comms, lambda c: tilewire.allgather(c, xs[c.rank], outs[c.rank]))

    Nothing inside fn may wait for the device: rank 0's collectives wait until the later ranks
    launch theirs, which happens only after fn(rank 0) returns. Allocate symmetric buffers
    before (the layers' reserve()), and call each torch kernel and library once before the
    first loop: a first call may load code or make a handle, which waits for the device (a
    cuBLAS matmul's first call at a shape loads its kernel; the layers' reserve(rows, grad=True)
    makes their backward's matmuls once at those rows).
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


# ---- op: gemm -----------------------------------------------------------------------------


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
    dtype = _check_out(out, m, n, out_dtype, op)
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



def _check_out(out, m, n, out_dtype, op):
    """The output dtype of a GEMM-like op: out's (checked: [m, n], bf16 or fp32, agreeing with
    out_dtype, rows strided by a multiple of 8) or out_dtype's (bf16 by default)."""
    if out is None:
        return torch.bfloat16 if out_dtype is None else out_dtype
    _check_tensor(out, "out", op)
    _check_dtype(out, "out", op, _GEMM_OUT_DTYPES)
    if out_dtype is not None and out.dtype != out_dtype:
        raise TypeError("%s: out is %s but out_dtype is %s" % (op, out.dtype, out_dtype))
    if out.dim() != 2 or tuple(out.shape) != (m, n):
        raise ValueError(
            "%s: out must be [M=%d, N=%d], got shape %s" % (op, m, n, tuple(out.shape))
        )
    _leading_dim(out, "out", op)
    return out.dtype

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


# ---- op: grouped_gemm ---------------------------------------------------------------------


def _grouped_b_ld(b, op):
    """The row stride of b [groups, N, K] read as one [groups * N, K] matrix, as
    tw_grouped_gemm reads it (group g's weights from row g * N, one leading dimension): each
    group row-major as _leading_dim checks it, the groups N rows apart."""
    groups, n, k = b.shape
    if groups == 0:
        return max(k, 1)  # nothing is read through it
    ld = _leading_dim(b[0], "b", op)
    if groups > 1 and n and k and b.stride(0) != n * ld:
        raise ValueError(
            "%s: b's groups must follow each other, N=%d rows of stride %d apart (a stride of "
            "%d between groups), got strides %s; pass b.contiguous()"
            % (op, n, ld, n * ld, tuple(b.stride()))
        )
    return ld


def _check_grouped_gemm(a, b, offsets, out, out_dtype):
    op = "tilewire.grouped_gemm"
    for t, name in ((a, "a"), (b, "b")):
        _check_tensor(t, name, op)
        _check_dtype(t, name, op, (torch.bfloat16,))
    if a.dim() != 2:
        raise ValueError("%s: a must be 2-D [M, K], got shape %s" % (op, tuple(a.shape)))
    if b.dim() != 3:
        raise ValueError("%s: b must be 3-D [groups, N, K], got shape %s" % (op, tuple(b.shape)))
    m, k = a.shape
    groups, n, kb = b.shape
    if kb != k:
        raise ValueError(
            "%s: a is [M=%d, K=%d] and b is [groups=%d, N=%d, K=%d]: their K differ "
            "(grouped_gemm computes a[rows of g] @ b[g].T)" % (op, m, k, groups, n, kb)
        )
    if k % 8:
        raise ValueError("%s: K=%d (a.shape[1]) must be a multiple of 8" % (op, k))
    if n % 8:
        raise ValueError("%s: N=%d (b.shape[1]) must be a multiple of 8" % (op, n))
    _check_tensor(offsets, "offsets", op)
    _check_dtype(offsets, "offsets", op, (torch.int32,))
    if offsets.dim() != 1 or offsets.shape[0] != groups + 1:
        raise ValueError("%s: offsets must be 1-D [groups + 1=%d], got shape %s"
                         % (op, groups + 1, tuple(offsets.shape)))
    if not offsets.is_contiguous():
        raise ValueError("%s: offsets must be contiguous; pass offsets.contiguous()" % op)
    if out_dtype is not None:
        if not isinstance(out_dtype, torch.dtype) or out_dtype not in _GEMM_OUT_DTYPES:
            raise TypeError(
                "%s: out_dtype must be torch.bfloat16 or torch.float32, got %r" % (op, out_dtype)
            )
    _leading_dim(a, "a", op)
    _grouped_b_ld(b, op)
    dtype = _check_out(out, m, n, out_dtype, op)
    # Devices last, so that the checks above also run on CPU and meta tensors.
    _check_cuda(a, "a", op, None)
    _check_cuda(b, "b", op, a.device)
    _check_cuda(offsets, "offsets", op, a.device)
    if out is not None:
        _check_cuda(out, "out", op, a.device)
    return dtype


def _launch_grouped_gemm(a, b, offsets, out):
    """Launches tw_grouped_gemm; returns its args struct (None where nothing was launched)."""
    m, k = a.shape
    groups, n, _ = b.shape
    if m == 0 or n == 0 or groups == 0:
        return None  # no row of out is in a group
    if k == 0:
        # Every row of a group is zero, the rows from offsets[groups] on untouched: a mask made
        # on the device (no host synchronisation, capturable as the kernel is).
        live = torch.arange(m, device=out.device) < offsets[groups]
        out.masked_fill_(live.unsqueeze(1), 0)
        return None
    op = "tilewire.grouped_gemm"
    _check_aligned(a, "a", op)
    _check_aligned(b, "b", op)
    _check_aligned(out, "out", op)
    args = _lib.GroupedGemmArgs(
        c_dtype=_lib.DType.BF16 if out.dtype == torch.bfloat16 else _lib.DType.FP32,
        a=a.data_ptr(), b=b.data_ptr(), out=out.data_ptr(), offsets=offsets.data_ptr(),
        m=m, n=n, k=k, groups=groups, lda=_leading_dim(a, "a", op), ldb=_grouped_b_ld(b, op),
        ldo=_leading_dim(out, "out", op),
    )
    with _on_device(a.device.index):  # tw_grouped_gemm runs on the current device
        _lib.call("tw_grouped_gemm", ctypes.byref(args), _stream(a.device))
    return args


@_custom_op("tilewire::grouped_gemm")
def _grouped_gemm_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    _launch_grouped_gemm(a, b, offsets, out)
    return out


@_register_fake(_grouped_gemm_op)
def _grouped_gemm_fake(a, b, offsets, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


# d_a and d_b on tilewire's kernels (tilewire._moe_grad)
_moe_grad.register_grouped_gemm_autograd(_grouped_gemm_op, _launch_grouped_gemm)


@_custom_op("tilewire::grouped_gemm_out", mutates_args=("out",))
def _grouped_gemm_out_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                         out: torch.Tensor) -> None:
    _launch_grouped_gemm(a, b, offsets, out)


@_register_fake(_grouped_gemm_out_op)
def _grouped_gemm_out_fake(a, b, offsets, out):
    return None


def _grouped_gemm_lane(hit, a, b, offsets, out):
    """A fast-lane hit of tilewire.grouped_gemm: out (allocated here when None), or None where
    the call must go the whole way."""
    tmpl, dtype = hit
    if not _direct_ok((a, b, offsets, out), () if out is None else (out,)) \
            or a.device.index != _current_device():
        return None
    given = out is not None
    if not given:
        out = torch.empty((a.shape[0], b.shape[1]), dtype=dtype, device=a.device)
    pa, pb, pc, po = a.data_ptr(), b.data_ptr(), out.data_ptr(), offsets.data_ptr()
    if (pa | pb | pc) & 15 or po & 3:
        return None
    args = _lane_args(tmpl)
    args.a, args.b, args.out, args.offsets = pa, pb, pc, po
    if given:
        _mutated((out,))
    _lib.call("tw_grouped_gemm", ctypes.byref(args), _stream(a.device))
    return out


def grouped_gemm(a, b, offsets, out=None, out_dtype=None):
    """Grouped GEMM over group-major rows (tw_grouped_gemm; an MoE layer's expert GEMMs):
    ``out[r] = a[r] @ b[g].T`` for every row r of group g, the rows
    ``offsets[g] <= r < offsets[g + 1]``.

    a: [M, K] bfloat16 (rows may be strided: row stride a multiple of 8 elements). b: [groups,
    N, K] bfloat16, group g's weights b[g] as tilewire.gemm takes them, the groups one after
    another (contiguous, or every row strided alike). offsets: an int32 CUDA tensor
    [groups + 1] on a's device, read by the kernel alone (no host synchronisation, so a kernel
    before it may write it, and a captured CUDA graph reads its contents at each replay):
    offsets[0] = 0, nondecreasing, every entry a multiple of 128 (each group padded to the
    128-row tile; an empty group has equal offsets) and offsets[groups] <= M. Offsets that break
    this give unspecified rows of out, never a fault or a write outside out. K and N multiples
    of 8. out: [M, N] in `out_dtype` (torch.bfloat16, the default, or torch.float32; with `out`,
    its dtype). fp32 accumulation; each group's rows are bitwise tilewire.gemm(a[rows], b[g]).

    Rows from offsets[groups] on are neither read nor written: an `out` given keeps them, and
    one allocated here (torch.empty) leaves them uninitialised. Runs on torch's current CUDA
    stream; CUDA-graph capturable; traceable by torch.compile (torch.ops.tilewire.grouped_gemm
    / grouped_gemm_out). Returns out.

    Differentiable in a and b without `out` (the autograd path goes through the custom op):
    d_a = d_out @ b[g] over each group's rows (zero on the rows of no group), d_b =
    tilewire.grouped_gemm_wgrad(d_out, a, offsets) (every row of a group, its padding rows
    too), both on tilewire's kernels with d_out rounded to bf16. A backward through the `out`
    form raises.
    """
    key = None
    if _lane_open(a, b, offsets, out):
        key, hit = _lane_find("grouped_gemm", _meta(a), _meta(b), _meta(offsets), _meta(out),
                              out_dtype)
        if hit is not None:
            done = _grouped_gemm_lane(hit, a, b, offsets, out)
            if done is not None:
                return done
    dtype = _check_grouped_gemm(a, b, offsets, out, out_dtype)
    if out is not None:
        args = _call_mutating(lambda *x: torch.ops.tilewire.grouped_gemm_out(*x),
                              _launch_grouped_gemm, (a, b, offsets, out), (out,),
                              a, b, offsets, out)
        _lane_put(key, (args, dtype))
        return out
    if _direct_ok((a, b, offsets), ()):
        out = torch.empty((a.shape[0], b.shape[1]), dtype=dtype, device=a.device)
        _lane_put(key, (_launch_grouped_gemm(a, b, offsets, out), dtype))
        return out
    if _HAVE_CUSTOM_OP:
        return torch.ops.tilewire.grouped_gemm(a, b, offsets, dtype)
    return _grouped_gemm_op(a, b, offsets, dtype)


# ---- op: allgather ------------------------------------------------------------------------

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
