"""The fused ops of the torch front end: ag_gemm (AllGather + GEMM), gemm_rs (GEMM +
ReduceScatter) and gemm_ar (GEMM + AllReduce), with their backward passes.

They live in one module because their backward passes call each other: ag_gemm's backward is
a gemm_rs and gemm_rs's an ag_gemm (the column- and row-parallel pair of tensor parallelism).
Each op is built as the unfused ones (_ops): a validating public function, a mutating custom
op with register_fake, and the direct path and fast lane of _eager.
"""

import ctypes

import torch

from . import _lib
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
    _check_aligned,
    _check_comm,
    _check_cuda,
    _check_dtype,
    _check_operands,
    _check_tensor,
    _custom_op,
    _leading_dim,
    _register_fake,
    _stream,
)
from ._ops import allgather
from ._symmetric import is_symmetric

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


def _weight_grad(g, x):
    """g.t() @ x: a linear layer's weight gradient from its output gradient g [m, n] and its
    input x [m, k]. The layers' backward and their warm-up (warm_backward) make this one call."""
    return torch.matmul(g.t(), x)


class _WarmBackward(torch.autograd.Function):
    """Runs ctx.fn in the backward: on the autograd engine's device thread, where the layers'
    backward matmuls run."""

    @staticmethod
    def forward(ctx, w, fn):
        ctx.fn = fn
        return w.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.fn()
        return grad, None


def warm_backward(fn, device):
    """Runs fn (the torch matmuls a layer's backward makes, on zeros of their shapes) on this
    thread and on the autograd engine's device thread. The first call of a cuBLAS kernel may
    load its code, and loading waits for the device: on virtual ranks, where one thread launches
    every rank's kernels and a rank's collective waits until the next rank launches its own,
    such a wait inside the ranks' loop never ends. So the layers' reserve(grad=True) makes each
    of those calls once, outside the loop."""
    fn()
    w = torch.zeros((), device=device, requires_grad=True)
    _WarmBackward.apply(w, fn).backward()


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
            grad_b = _weight_grad(g, gathered)
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
        grad_b = _weight_grad(gathered, a) if need_b else None
        return None, None, grad_a, grad_b, None, None, None, None, None
