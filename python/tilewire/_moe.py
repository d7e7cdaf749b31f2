"""The MoE expert-parallel ops of the torch front end, inside a node: moe_dispatch (the token
dispatch into the experts' ranks), moe_combine (the weighted combine back), moe_dispatch_gemm
(the dispatch fused with the experts' grouped GEMM) and moe_ffn (the whole expert FFN, dispatch
to combine, in one kernel), with moe_workspace and moe_recv_rows to size their buffers and
swiglu, the FFN's elementwise step on its own (tilewire.h, "MoE expert parallelism inside a
node").

Built as the fused ops (_fused): a validating public function (metadata only, TypeError or
ValueError naming the argument, before any CUDA call) and a mutating custom op with
register_fake, called directly where nothing needs the dispatcher (_eager). Routing is read on
the GPU from topk_idx: no host synchronisation, CUDA-graph capturable; a routing the buffers
cannot hold, or an expert index out of range, is found on the device and reported by
comm.async_error() (InvalidArgumentError; the comm is then unusable). moe_dispatch,
moe_combine, moe_dispatch_gemm and moe_ffn are differentiable (their backwards: _moe_grad).
"""

import contextlib

import torch

from . import _moe_grad
from ._eager import _call_mutating
from ._glue import (
    _check_comm,
    _check_cuda,
    _check_dtype,
    _check_tensor,
    _custom_op,
    _register_fake,
)
from ._moe_launch import (
    _combine_impl,
    _dispatch_impl,
    _ffn_impl,
    _gemm_dispatch_impl,
    _swiglu_impl,
)

bf16 = torch.bfloat16
_INDEX_DTYPES = (torch.int32, torch.int64)
_MAX_EXPERTS = 1024  # tilewire.h: experts <= 1024, top_k 1 .. 16
_MAX_TOP_K = 16

# ---- sizes --------------------------------------------------------------------------------


def _check_int(value, name, op, low=0):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("%s: %s must be an int, got %r" % (op, name, value))
    if value < low:
        raise ValueError("%s: %s must be >= %d, got %d" % (op, name, low, value))
    return value


def _check_experts(op, world, experts):
    """experts: an int in 1 .. 1024, a multiple of world. Returns the local experts."""
    _check_int(experts, "experts", op, 1)
    if experts > _MAX_EXPERTS or experts % world:
        raise ValueError("%s: experts=%d must be at most %d and a multiple of the world (%d)"
                         % (op, experts, _MAX_EXPERTS, world))
    return experts // world


def moe_recv_rows(world, max_tokens, experts, top_k):
    """The rows a recv (and expert_out) buffer must have so that no routing of at most
    max_tokens tokens per rank, top_k distinct experts each, can overflow it:
    max_tokens * world * min(top_k, experts // world) + 127 * (experts // world) (each local
    expert's rows padded to 128), rounded up to a multiple of 128. Pure Python."""
    op = "tilewire.moe_recv_rows"
    _check_int(world, "world", op, 1)
    _check_int(max_tokens, "max_tokens", op, 0)
    _check_int(top_k, "top_k", op, 1)
    local = _check_experts(op, world, experts)
    rows = max_tokens * world * min(top_k, local) + 127 * local
    return (rows + 127) // 128 * 128


def moe_workspace(comm, max_tokens, experts, top_k, hidden=0):
    """The symmetric workspace tw_moe_dispatch / tw_moe_combine / tw_moe_dispatch_gemm need on
    comm for at most max_tokens tokens per rank: a uint8 tensor from comm.empty (collective:
    every rank calls it alike). Allocate it once and reuse it; a dispatch and the combine after
    it use the same workspace (it holds the routing between them). hidden: the widest row the
    calls move (x's columns, expert_out's); needed only when comm spans nodes (the workspace
    then stages rows), not read inside one."""
    op = "tilewire.moe_workspace"
    _check_comm(comm, op)
    _check_int(max_tokens, "max_tokens", op, 0)
    _check_int(top_k, "top_k", op, 1)
    _check_experts(op, comm.size, experts)
    _check_int(hidden, "hidden", op, 0)
    return comm.empty((max(comm.moe_workspace_size(max_tokens, experts, top_k, hidden), 1),),
                      torch.uint8)


# ---- argument checks (metadata only) ------------------------------------------------------


def _check_matrix(op, t, name, dtypes, rows, cols, shape):
    """t: a contiguous 2-D tensor of one of `dtypes` with `rows` and `cols` (None: any);
    `shape` names them for the message. Returns t.shape."""
    _check_tensor(t, name, op)
    _check_dtype(t, name, op, dtypes)
    if t.dim() != 2 or (rows is not None and t.shape[0] != rows) or (
            cols is not None and t.shape[1] != cols):
        raise ValueError("%s: %s must be 2-D %s, got shape %s" % (op, name, shape, tuple(t.shape)))
    _check_contiguous(op, t, name)
    return tuple(t.shape)


def _check_contiguous(op, t, name):
    if not t.is_contiguous():
        raise ValueError("%s: %s must be contiguous (packed rows); pass %s.contiguous()"
                         % (op, name, name))


def _check_multiple_of_8(op, value, what):
    if value < 8 or value % 8:
        raise ValueError("%s: %s must be a positive multiple of 8" % (op, what % value))


def _check_routing(op, comm, topk_idx, workspace, max_tokens, experts):
    """comm, experts, max_tokens, topk_idx [tokens, top_k] and the workspace's size: returns
    (tokens, top_k, local experts)."""
    _check_comm(comm, op)
    local = _check_experts(op, comm.size, experts)
    _check_int(max_tokens, "max_tokens", op, 0)
    _check_tensor(topk_idx, "topk_idx", op)
    _check_dtype(topk_idx, "topk_idx", op, _INDEX_DTYPES)
    if topk_idx.dim() != 2:
        raise ValueError("%s: topk_idx must be 2-D [tokens, top_k], got shape %s"
                         % (op, tuple(topk_idx.shape)))
    tokens, top_k = topk_idx.shape
    if not 1 <= top_k <= min(_MAX_TOP_K, experts):
        raise ValueError("%s: top_k=%d (topk_idx.shape[1]) must be 1 .. %d and at most "
                         "experts=%d" % (op, top_k, _MAX_TOP_K, experts))
    if tokens > max_tokens:
        raise ValueError("%s: topk_idx has %d tokens (rows), more than max_tokens=%d"
                         % (op, tokens, max_tokens))
    _check_contiguous(op, topk_idx, "topk_idx")
    _check_tensor(workspace, "workspace", op)
    _check_contiguous(op, workspace, "workspace")
    return tokens, top_k, local


def _check_workspace(op, comm, workspace, max_tokens, experts, top_k, width):
    """The workspace's size for calls moving rows of `width` columns (read across nodes)."""
    need = comm.moe_workspace_size(max_tokens, experts, top_k, width)
    have = workspace.numel() * workspace.element_size()
    if have < need:
        wide = ", hidden=%d" % width if comm.nodes > 1 else ""
        raise ValueError("%s: workspace has %d bytes; it needs %d (tilewire.moe_workspace(comm, "
                         "%d, %d, %d%s))" % (op, have, need, max_tokens, experts, top_k, wide))


def _check_offsets(op, offsets, local):
    _check_tensor(offsets, "offsets", op)
    _check_dtype(offsets, "offsets", op, (torch.int32,))
    if offsets.dim() != 1 or offsets.shape[0] != local + 1:
        raise ValueError("%s: offsets must be 1-D [local experts + 1=%d], got shape %s"
                         % (op, local + 1, tuple(offsets.shape)))
    _check_contiguous(op, offsets, "offsets")


def _check_devices(op, comm, named):
    """Last, so that the checks before also run on CPU and meta tensors."""
    device = torch.device("cuda", comm.device)
    for name, t in named:
        if t is not None:
            _check_cuda(t, name, op, device)


def _check_x_recv(op, x, recv, tokens):
    """The dispatch's x [tokens, hidden] and recv [recv_rows, hidden]: (hidden, recv_rows)."""
    _, hidden = _check_matrix(op, x, "x", (bf16,), tokens, None,
                              "[tokens=%d (topk_idx's rows), hidden]" % tokens)
    _check_multiple_of_8(op, hidden, "hidden=%d (x.shape[1])")
    recv_rows, _ = _check_matrix(op, recv, "recv", (bf16,), None, hidden,
                                 "[recv_rows, hidden=%d] (comm.empty)" % hidden)
    if recv_rows < 1:
        raise ValueError("%s: recv has no rows (tilewire.moe_recv_rows gives enough)" % op)
    return hidden, recv_rows


def _check_dispatch(op, comm, x, topk_idx, recv, offsets, workspace, max_tokens, experts,
                    gemm=False, weights=None, expert_out=None):
    """moe_dispatch's arguments, and moe_dispatch_gemm's (gemm: weights and expert_out too).
    Returns the local experts."""
    tokens, top_k, local = _check_routing(op, comm, topk_idx, workspace, max_tokens, experts)
    hidden, recv_rows = _check_x_recv(op, x, recv, tokens)
    _check_workspace(op, comm, workspace, max_tokens, experts, top_k, hidden)
    if offsets is not None:
        _check_offsets(op, offsets, local)
    named = [("x", x), ("topk_idx", topk_idx), ("recv", recv), ("offsets", offsets),
             ("workspace", workspace)]
    if gemm:
        _check_tensor(weights, "weights", op)
        _check_dtype(weights, "weights", op, (bf16,))
        if weights.dim() != 3 or weights.shape[0] != local or weights.shape[2] != hidden:
            raise ValueError("%s: weights must be 3-D [local experts=%d, n_out, hidden=%d], got "
                             "shape %s" % (op, local, hidden, tuple(weights.shape)))
        _check_contiguous(op, weights, "weights")
        n_out = weights.shape[1]
        _check_multiple_of_8(op, n_out, "n_out=%d (weights.shape[1])")
        _check_matrix(op, expert_out, "expert_out", (bf16,), recv_rows, n_out,
                      "[recv_rows=%d (recv's rows), n_out=%d]" % (recv_rows, n_out))
        named += [("weights", weights), ("expert_out", expert_out)]
    _check_devices(op, comm, named)
    return local


def _check_combine(op, comm, expert_out, topk_idx, topk_weights, workspace, out, max_tokens,
                   experts):
    tokens, top_k, _ = _check_routing(op, comm, topk_idx, workspace, max_tokens, experts)
    recv_rows, n_out = _check_matrix(op, expert_out, "expert_out", (bf16,), None, None,
                                     "[recv_rows, n_out] (comm.empty)")
    if recv_rows < 1:
        raise ValueError("%s: expert_out has no rows (tilewire.moe_recv_rows gives enough)" % op)
    _check_multiple_of_8(op, n_out, "n_out=%d (expert_out.shape[1])")
    _check_workspace(op, comm, workspace, max_tokens, experts, top_k, n_out)
    _check_matrix(op, topk_weights, "topk_weights", (torch.float32,), tokens, top_k,
                  "[tokens=%d, top_k=%d] (topk_idx's shape)" % (tokens, top_k))
    if out is not None:
        _check_matrix(op, out, "out", (bf16,), tokens, n_out,
                      "[tokens=%d, n_out=%d]" % (tokens, n_out))
    _check_devices(op, comm, (("expert_out", expert_out), ("topk_idx", topk_idx),
                              ("topk_weights", topk_weights), ("workspace", workspace),
                              ("out", out)))
    return tokens, n_out


def _check_experts_weights(op, t, name, local, rows, cols, shape):
    """t: a contiguous bf16 [local, rows, cols] tensor (rows or cols None: any); `shape` names
    the dimensions for the message. Returns t.shape."""
    _check_tensor(t, name, op)
    _check_dtype(t, name, op, (bf16,))
    if t.dim() != 3 or t.shape[0] != local or (rows is not None and t.shape[1] != rows) or (
            cols is not None and t.shape[2] != cols):
        raise ValueError("%s: %s must be 3-D %s, got shape %s" % (op, name, shape, tuple(t.shape)))
    _check_contiguous(op, t, name)
    return tuple(t.shape)


def _check_inter(op, two_inter, where):
    """two_inter: the gate | up columns (2 inter); returns inter, a positive multiple of 8."""
    if two_inter % 2:
        raise ValueError("%s: %s=%d must be 2 inter (the gate's columns then the up's), even"
                         % (op, where, two_inter))
    _check_multiple_of_8(op, two_inter // 2, "inter=%%d (%s / 2)" % where)
    return two_inter // 2


def _check_stream(op, stream):
    if stream is not None and not isinstance(stream, torch.cuda.Stream):
        raise TypeError("%s: stream must be a torch.cuda.Stream or None, got %s"
                        % (op, type(stream).__name__))


def _check_stream_device(op, stream, device):
    """Last, with the devices: stream on `device` (a torch.device)."""
    if stream is not None and stream.device != device:
        raise ValueError("%s: stream is on %s, expected %s" % (op, stream.device, device))


def _check_ffn(op, comm, x, topk_idx, topk_weights, w13, w2, workspace, recv, expert_out, out,
               h, act, max_tokens, experts, stream):
    """moe_ffn's arguments: the dispatch's, the combine's, both weights and h / act. Returns
    (tokens, local experts, hidden, inter, recv_rows)."""
    tokens, top_k, local = _check_routing(op, comm, topk_idx, workspace, max_tokens, experts)
    hidden, recv_rows = _check_x_recv(op, x, recv, tokens)
    _check_workspace(op, comm, workspace, max_tokens, experts, top_k, hidden)
    _check_matrix(op, topk_weights, "topk_weights", (torch.float32,), tokens, top_k,
                  "[tokens=%d, top_k=%d] (topk_idx's shape)" % (tokens, top_k))
    _, two_inter, _ = _check_experts_weights(
        op, w13, "w13", local, None, hidden,
        "[local experts=%d, 2 inter, hidden=%d] (gate rows then up rows)" % (local, hidden))
    inter = _check_inter(op, two_inter, "w13.shape[1]")
    _check_experts_weights(op, w2, "w2", local, hidden, inter,
                           "[local experts=%d, hidden=%d, inter=%d]" % (local, hidden, inter))
    _check_matrix(op, expert_out, "expert_out", (bf16,), recv_rows, hidden,
                  "[recv_rows=%d (recv's rows), hidden=%d] (comm.empty)" % (recv_rows, hidden))
    if h is not None:
        _check_matrix(op, h, "h", (bf16,), recv_rows, 2 * inter,
                      "[recv_rows=%d, 2 inter=%d]" % (recv_rows, 2 * inter))
    if act is not None:
        _check_matrix(op, act, "act", (bf16,), recv_rows, inter,
                      "[recv_rows=%d, inter=%d]" % (recv_rows, inter))
    if out is not None:
        _check_matrix(op, out, "out", (bf16,), tokens, hidden,
                      "[tokens=%d, hidden=%d]" % (tokens, hidden))
    _check_stream(op, stream)
    _check_devices(op, comm, (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights),
                              ("w13", w13), ("w2", w2), ("recv", recv), ("expert_out", expert_out),
                              ("workspace", workspace), ("h", h), ("act", act), ("out", out)))
    _check_stream_device(op, stream, torch.device("cuda", comm.device))
    return tokens, local, hidden, inter, recv_rows


def _check_swiglu(op, h, out, stream):
    """swiglu's arguments: h bf16 [rows, 2 inter], out [rows, inter]. Returns (rows, inter)."""
    rows, two_inter = _check_matrix(op, h, "h", (bf16,), None, None, "[rows, 2 inter]")
    inter = _check_inter(op, two_inter, "h.shape[1]")
    if out is not None:
        _check_matrix(op, out, "out", (bf16,), rows, inter,
                      "[rows=%d, inter=%d]" % (rows, inter))
    _check_stream(op, stream)
    _check_cuda(h, "h", op, None)
    if out is not None:
        _check_cuda(out, "out", op, h.device)
    _check_stream_device(op, stream, h.device)
    return rows, inter


# ---- custom ops ---------------------------------------------------------------------------


@_custom_op("tilewire::moe_dispatch", mutates_args=("recv", "offsets", "workspace"))
def _moe_dispatch_op(comm_id: int, x: torch.Tensor, topk_idx: torch.Tensor, recv: torch.Tensor,
                     offsets: torch.Tensor, workspace: torch.Tensor, max_tokens: int,
                     experts: int) -> None:
    _dispatch_impl(comm_id, x, topk_idx, recv, offsets, workspace, max_tokens, experts)


@_register_fake(_moe_dispatch_op)
def _moe_dispatch_fake(comm_id, x, topk_idx, recv, offsets, workspace, max_tokens, experts):
    return None


@_custom_op("tilewire::moe_dispatch_gemm",
            mutates_args=("recv", "expert_out", "offsets", "workspace"))
def _moe_dispatch_gemm_op(comm_id: int, x: torch.Tensor, topk_idx: torch.Tensor,
                          weights: torch.Tensor, recv: torch.Tensor, expert_out: torch.Tensor,
                          offsets: torch.Tensor, workspace: torch.Tensor, max_tokens: int,
                          experts: int) -> None:
    _gemm_dispatch_impl(comm_id, x, topk_idx, weights, recv, expert_out, offsets, workspace,
                        max_tokens, experts)


@_register_fake(_moe_dispatch_gemm_op)
def _moe_dispatch_gemm_fake(comm_id, x, topk_idx, weights, recv, expert_out, offsets, workspace,
                            max_tokens, experts):
    return None


@_custom_op("tilewire::moe_combine", mutates_args=("out",))
def _moe_combine_op(comm_id: int, expert_out: torch.Tensor, topk_idx: torch.Tensor,
                    topk_weights: torch.Tensor, workspace: torch.Tensor, out: torch.Tensor,
                    max_tokens: int, experts: int) -> None:
    _combine_impl(comm_id, expert_out, topk_idx, topk_weights, workspace, out, max_tokens,
                  experts)


@_register_fake(_moe_combine_op)
def _moe_combine_fake(comm_id, expert_out, topk_idx, topk_weights, workspace, out, max_tokens,
                      experts):
    return None


@_custom_op("tilewire::moe_ffn",
            mutates_args=("recv", "offsets", "h", "act", "expert_out", "workspace", "out"))
def _moe_ffn_op(comm_id: int, x: torch.Tensor, topk_idx: torch.Tensor,
                topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                recv: torch.Tensor, offsets: torch.Tensor, h: torch.Tensor, act: torch.Tensor,
                expert_out: torch.Tensor, workspace: torch.Tensor, out: torch.Tensor,
                max_tokens: int, experts: int) -> None:
    _ffn_impl(comm_id, x, topk_idx, topk_weights, w13, w2, recv, offsets, h, act, expert_out,
              workspace, out, max_tokens, experts)


@_register_fake(_moe_ffn_op)
def _moe_ffn_fake(comm_id, x, topk_idx, topk_weights, w13, w2, recv, offsets, h, act,
                  expert_out, workspace, out, max_tokens, experts):
    return None


@_custom_op("tilewire::swiglu", mutates_args=("out",))
def _swiglu_op(h: torch.Tensor, out: torch.Tensor) -> None:
    _swiglu_impl(h, out)


@_register_fake(_swiglu_op)
def _swiglu_fake(h, out):
    return None


def _on_stream(stream):
    """torch.cuda.stream(stream) (which also makes its device current), or nothing for None."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


# ---- the public functions -----------------------------------------------------------------


def moe_dispatch(comm, x, topk_idx, recv, offsets, workspace, max_tokens, *, experts,
                 grad_buffer=None):
    """The MoE token dispatch (tw_moe_dispatch): every (token t, slot j) with
    topk_idx[t, j] = e >= 0 copies x[t] into the recv of expert e's rank (rank r holds experts
    [r * experts / world, (r + 1) * experts / world)), expert-major: each local expert's rows
    start at offsets[e_local], a multiple of 128; inside an expert by source rank, inside a
    source in token order. offsets[local experts] is the end of the last expert's padded rows
    (the grouped GEMM's offsets: tilewire.grouped_gemm(recv, weights, offsets)). Rows past an
    expert's live rows up to the next multiple of 128 are left as they were.

    x: bf16 [tokens, hidden], contiguous, hidden a multiple of 8, tokens <= max_tokens (ranks
    may differ); topk_idx: int32 or int64 [tokens, top_k], contiguous, global expert ids (-1:
    an unused slot; a token's slots name distinct experts); recv: a symmetric bf16
    [recv_rows, hidden] tensor (comm.empty; tilewire.moe_recv_rows gives rows no routing can
    overflow); offsets: int32 [experts / world + 1] (allocated when None); workspace: from
    tilewire.moe_workspace(comm, max_tokens, experts, top_k); max_tokens and experts (keyword)
    alike on every rank. Collective; runs on torch's current stream with no host
    synchronisation (CUDA-graph capturable). Returns (recv, offsets) once (in stream order)
    every rank's rows have landed in this rank's recv.

    A routing needing more than recv_rows rows at some rank, or an expert index outside
    [-1, experts), is found on the device: no rank copies anything and comm.async_error()
    reports an InvalidArgumentError naming it (the comm is then unusable).

    Differentiable in x (when x requires grad): the returned recv is then a new tensor over
    recv's memory, and the backward sums each token's rows of recv's gradient (the combine with
    weights 1), through grad_buffer: a symmetric bf16 tensor shaped as recv (comm.empty),
    needed then. recv, offsets, workspace and grad_buffer must not serve another call before
    the backward has run (tilewire._moe_grad).
    """
    op = "tilewire.moe_dispatch"
    local = _check_dispatch(op, comm, x, topk_idx, recv, offsets, workspace, max_tokens,
                            experts)
    if offsets is None:
        offsets = torch.empty(local + 1, dtype=torch.int32, device=x.device)
    if _moe_grad.needs_grad(x):
        _moe_grad._check_grad_buffer(op, comm, grad_buffer, "grad_buffer", *recv.shape)
        spec = _moe_grad._Spec(comm=comm, topk_idx=topk_idx, recv=recv, offsets=offsets,
                               workspace=workspace, max_tokens=max_tokens, experts=experts,
                               grad_buffer=grad_buffer)
        return _moe_grad.MoeDispatchFn.apply(x, spec), offsets
    _call_mutating(lambda *a: torch.ops.tilewire.moe_dispatch(*a), _dispatch_impl,
                   (x, topk_idx, recv, offsets, workspace), (recv, offsets, workspace),
                   comm.id, x, topk_idx, recv, offsets, workspace, max_tokens, experts)
    return recv, offsets


def moe_combine(comm, expert_out, topk_idx, topk_weights, workspace, max_tokens, *, experts,
                out=None, expert_grad=None):
    """The MoE weighted combine (tw_moe_combine): out[t] = sum over slots j in order of
    topk_weights[t, j] * expert_out row of (t, j), in fp32 (fused multiply-adds), rounded to
    bf16 once; the rows are read in place from the experts' ranks, in the layout the last
    moe_dispatch (or moe_dispatch_gemm) of the same workspace recorded, which must have had the
    same tokens and topk_idx. Every rank calls it after its expert GEMM.

    expert_out: a symmetric bf16 [recv_rows, n_out] tensor (comm.empty, the rows of recv's
    layout), n_out a multiple of 8; topk_idx: as given to the dispatch; topk_weights: float32
    [tokens, top_k], contiguous; out: bf16 [tokens, n_out], contiguous (allocated when None).
    Collective; on torch's current stream, CUDA-graph capturable. Returns out.

    Differentiable in expert_out and topk_weights (when either requires grad): out is then a
    new tensor over out's memory, and the backward (tilewire.h's tw_moe_combine_backward)
    writes expert_out's gradient into expert_grad, a symmetric bf16 tensor shaped as
    expert_out (comm.empty), needed then, with every expert's padding rows zero; expert_out,
    workspace and expert_grad must not serve another call before the backward has run.
    """
    op = "tilewire.moe_combine"
    tokens, n_out = _check_combine(op, comm, expert_out, topk_idx, topk_weights, workspace, out,
                                   max_tokens, experts)
    if out is None:
        out = torch.empty((tokens, n_out), dtype=bf16, device=expert_out.device)
    if _moe_grad.needs_grad(expert_out, topk_weights):
        _moe_grad._check_grad_buffer(op, comm, expert_grad, "expert_grad", *expert_out.shape)
        spec = _moe_grad._Spec(comm=comm, topk_idx=topk_idx, expert_out=expert_out,
                               workspace=workspace, max_tokens=max_tokens, experts=experts,
                               out=out, expert_grad=expert_grad)
        return _moe_grad.MoeCombineFn.apply(expert_out, topk_weights, spec)
    _call_mutating(lambda *a: torch.ops.tilewire.moe_combine(*a), _combine_impl,
                   (expert_out, topk_idx, topk_weights, workspace, out), (out,),
                   comm.id, expert_out, topk_idx, topk_weights, workspace, out, max_tokens,
                   experts)
    return out


def moe_dispatch_gemm(comm, x, topk_idx, weights, recv, expert_out, offsets, workspace,
                      max_tokens, *, experts, grad_buffer=None):
    """moe_dispatch and tilewire.grouped_gemm(recv, weights, offsets, out=expert_out) of this
    rank's local experts in one persistent kernel (tw_moe_dispatch_gemm): each 128-row tile of
    an expert starts as soon as its rows have landed. recv, offsets and expert_out's live rows
    are bitwise those of the two calls.

    Arguments as moe_dispatch, and weights: bf16 [experts / world, n_out, hidden], contiguous,
    this rank's experts' weights (n_out a multiple of 8); expert_out: bf16 [recv_rows, n_out],
    contiguous (symmetric, comm.empty, when moe_combine reads it next). Collective; on torch's
    current stream. Returns (expert_out, offsets).

    Differentiable in x and weights (when either requires grad): the returned expert_out is
    then a new tensor over expert_out's memory, and the backward runs on tilewire's kernels:
    d_weights = tilewire.grouped_gemm_wgrad(d_expert_out, recv, offsets), d_recv = the grouped
    GEMM of d_expert_out over the transposed weights, and the dispatch's backward (each
    token's rows of d_recv summed, as moe_dispatch's) through grad_buffer: a symmetric bf16
    tensor shaped as recv (comm.empty), needed when x requires grad. recv, offsets, workspace
    and grad_buffer must not serve another call before the backward has run, and recv must
    hold finite values in every row (create it zeroed once): d_weights sums each expert's
    padding rows too, as grouped_gemm's backward does.
    """
    op = "tilewire.moe_dispatch_gemm"
    local = _check_dispatch(op, comm, x, topk_idx, recv, offsets, workspace, max_tokens,
                            experts, True, weights, expert_out)
    if offsets is None:
        offsets = torch.empty(local + 1, dtype=torch.int32, device=x.device)
    if _moe_grad.needs_grad(x, weights):
        if _moe_grad.needs_grad(x):  # d_recv passes through grad_buffer
            _moe_grad._check_grad_buffer(op, comm, grad_buffer, "grad_buffer", *recv.shape)
        spec = _moe_grad._Spec(comm=comm, topk_idx=topk_idx, recv=recv, offsets=offsets,
                               expert_out=expert_out, workspace=workspace,
                               max_tokens=max_tokens, experts=experts, grad_buffer=grad_buffer)
        return _moe_grad.MoeDispatchGemmFn.apply(x, weights, spec), offsets
    _call_mutating(lambda *a: torch.ops.tilewire.moe_dispatch_gemm(*a), _gemm_dispatch_impl,
                   (x, topk_idx, weights, recv, expert_out, offsets, workspace),
                   (recv, expert_out, offsets, workspace),
                   comm.id, x, topk_idx, weights, recv, expert_out, offsets, workspace,
                   max_tokens, experts)
    return expert_out, offsets


def moe_ffn(comm, x, topk_idx, topk_weights, w13, w2, *, workspace, recv, expert_out,
            max_tokens, experts, out=None, h=None, act=None, stream=None, grad_buffer=None):
    """The expert FFN of an MoE layer, dispatch to combine, in one persistent kernel
    (tw_moe_ffn): moe_dispatch of x by topk_idx into recv; h = recv @ w13[e].T over each local
    expert e's rows (the gate and up projections); act = tilewire.swiglu(h); expert_out =
    act @ w2[e].T (the down projection); then moe_combine of expert_out into out with
    topk_weights. Each stage's 128-row block starts as soon as the stage before has finished
    it. recv, h's, act's and expert_out's live rows and out are bitwise those of moe_dispatch,
    tilewire.grouped_gemm(recv, w13, offsets), tilewire.swiglu,
    tilewire.grouped_gemm(act, w2, offsets) and moe_combine.

    x, topk_idx, recv, workspace, max_tokens and experts as moe_dispatch takes them;
    topk_weights and out as moe_combine's (out: bf16 [tokens, hidden]); w13: bf16
    [experts / world, 2 inter, hidden], contiguous, each local expert's gate rows then its up
    rows (inter a multiple of 8); w2: bf16 [experts / world, hidden, inter], contiguous;
    expert_out: a symmetric bf16 [recv_rows, hidden] tensor (comm.empty); h: bf16 [recv_rows,
    2 inter] and act: bf16 [recv_rows, inter], contiguous device memory of this rank (any
    CUDA tensor apart from the others; out, h and act are allocated when None); recv_rows at
    most 8000 row blocks of 128 (the library refuses more). The dispatch's offsets go to a
    tensor of the call's own. Collective; runs on `stream` (a torch.cuda.Stream on the comm's
    device; None: torch's current stream, as the other MoE ops) with no host synchronisation
    (CUDA-graph capturable). Returns out.

    Routing errors are found on the device as moe_dispatch's (comm.async_error()).

    Differentiable in x, topk_weights, w13 and w2 (when any requires grad): out is then a new
    tensor over out's memory, and the backward runs on tilewire's kernels (the combine's
    backward, the grouped GEMMs' input and weight gradients, the dispatch's backward; SwiGLU's
    in torch, fp32) through grad_buffer: a symmetric bf16 [recv_rows, hidden] tensor
    (comm.empty), needed then. recv, h, act, expert_out, workspace and grad_buffer must not
    serve another call before the backward has run, and recv, h and act must hold finite
    values in every row (create them zeroed once): the weight gradients sum each expert's
    padding rows, whose gradient rows are zero.
    """
    op = "tilewire.moe_ffn"
    tokens, local, hidden, inter, recv_rows = _check_ffn(
        op, comm, x, topk_idx, topk_weights, w13, w2, workspace, recv, expert_out, out, h, act,
        max_tokens, experts, stream)
    with _on_stream(stream):  # allocated on the stream that uses them
        device = x.device
        offsets = torch.empty(local + 1, dtype=torch.int32, device=device)
        grad = _moe_grad.needs_grad(x, topk_weights, w13, w2)
        alloc = torch.zeros if grad else torch.empty  # the backward reads every padding row
        if h is None:
            h = alloc((recv_rows, 2 * inter), dtype=bf16, device=device)
        if act is None:
            act = alloc((recv_rows, inter), dtype=bf16, device=device)
        if out is None:
            out = torch.empty((tokens, hidden), dtype=bf16, device=device)
        if grad:
            _moe_grad._check_grad_buffer(op, comm, grad_buffer, "grad_buffer", recv_rows,
                                         hidden)
            spec = _moe_grad._Spec(comm=comm, topk_idx=topk_idx, recv=recv, offsets=offsets,
                                   h=h, act=act, expert_out=expert_out, workspace=workspace,
                                   out=out, max_tokens=max_tokens, experts=experts,
                                   grad_buffer=grad_buffer)
            return _moe_grad.MoeFfnFn.apply(x, topk_weights, w13, w2, spec)
        _call_mutating(lambda *a: torch.ops.tilewire.moe_ffn(*a), _ffn_impl,
                       (x, topk_idx, topk_weights, w13, w2, recv, offsets, h, act, expert_out,
                        workspace, out),
                       (recv, offsets, h, act, expert_out, workspace, out),
                       comm.id, x, topk_idx, topk_weights, w13, w2, recv, offsets, h, act,
                       expert_out, workspace, out, max_tokens, experts)
    return out


def swiglu(h, out=None, stream=None):
    """The SwiGLU step between an MoE expert's gate/up and down projections (tw_swiglu):
    out[r, i] = bf16(silu(g) * u) for g = h[r, i], u = h[r, inter + i], in fp32 with silu(g) =
    g / (1 + exp(-g)); the same bits as moe_ffn's act.

    h: a bf16 CUDA tensor [rows, 2 inter], contiguous, gate columns then up columns (inter a
    multiple of 8); out: bf16 [rows, inter], contiguous, on h's device, apart from h (allocated
    when None). Runs on `stream` (a torch.cuda.Stream on h's device; None: torch's current
    stream), CUDA-graph capturable. Returns out. Not differentiable (no autograd).
    """
    op = "tilewire.swiglu"
    rows, inter = _check_swiglu(op, h, out, stream)
    with _on_stream(stream):
        if out is None:
            out = torch.empty((rows, inter), dtype=bf16, device=h.device)
        _call_mutating(lambda *a: torch.ops.tilewire.swiglu(*a), _swiglu_impl, (h, out), (out,),
                       h, out)
    return out
