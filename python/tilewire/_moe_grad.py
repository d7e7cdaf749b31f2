"""Autograd of the grouped GEMM and of the MoE ops (tilewire.h: tw_grouped_gemm_wgrad,
tw_moe_combine_backward).

Every backward runs on tilewire's own kernels, on the stream of its forward, with no host
synchronisation:
  grouped_gemm       d_a = grouped_gemm(d_out, b[g].T) per group (rows of no group: zero),
                     d_b = grouped_gemm_wgrad(d_out, a) (each group's rows, padding included)
  moe_combine        d_expert_out and d_topk_weights: moe_combine_backward (the gradient rows
                     written into a symmetric expert_grad, each expert's padding rows zeroed)
  moe_dispatch       d_x = moe_combine of d_recv with every weight 1 (a token's rows summed)
  moe_dispatch_gemm  the grouped GEMM's d_weights (grouped_gemm_wgrad of d_expert_out and recv)
                     and d_recv (the grouped GEMM over the transposed weights, into
                     grad_buffer), then the dispatch's backward
  moe_ffn            the chain of the above: the combine's backward into grad_buffer, the down
                     GEMM's d_act and d_w2, SwiGLU's backward (torch, fp32), the gate/up GEMM's
                     d_recv (into grad_buffer again) and d_w13, the dispatch's backward.
The MoE backwards read the routing the forward's dispatch recorded in the workspace, and the
forward's recv, h, act and expert_out: none of these may be reused by another call between a
forward and its backward (give each layer its own). The weight gradients sum every row of an
expert's 128-row blocks, so the padding rows must hold finite values: create recv (and h, act)
zeroed once (the dispatch and the GEMMs then only ever write finite rows from finite inputs);
the gradient rows there are zero.
"""

import ctypes

import torch

from . import _lib
from ._glue import (
    _HAVE_CUSTOM_OP,
    _check_aligned,
    _check_cuda,
    _check_dtype,
    _check_tensor,
    _custom_op,
    _on_device,
    _register_fake,
    _stream,
)
from ._moe_launch import (
    _combine_impl,
    _dispatch_impl,
    _ffn_impl,
    _gemm_dispatch_impl,
    _moe_args,
    _need_symmetric,
    _ptr,
)

bf16 = torch.bfloat16
_WGRAD_DTYPES = (torch.bfloat16, torch.float32)

# ---- grouped_gemm_wgrad -------------------------------------------------------------------


def _check_wgrad(a, b, offsets, out, out_dtype):
    op = "tilewire.grouped_gemm_wgrad"
    for t, name in ((a, "a"), (b, "b")):
        _check_tensor(t, name, op)
        _check_dtype(t, name, op, (bf16,))
        if t.dim() != 2:
            raise ValueError("%s: %s must be 2-D [M, %s], got shape %s"
                             % (op, name, "N" if name == "a" else "K", tuple(t.shape)))
        if t.shape[1] % 8 or (t.shape[0] > 1 and t.stride(0) % 8) or t.stride(1) != 1:
            raise ValueError("%s: %s's rows must be contiguous with %d columns and a row stride "
                             "a multiple of 8 elements" % (op, name, t.shape[1]))
    if a.shape[0] != b.shape[0]:
        raise ValueError("%s: a has %d rows but b has %d (both are the grouped GEMM's rows)"
                         % (op, a.shape[0], b.shape[0]))
    _check_tensor(offsets, "offsets", op)
    if offsets.dtype != torch.int32 or offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError("%s: offsets must be a 1-D int32 tensor [groups + 1]" % op)
    groups, n, k = offsets.numel() - 1, a.shape[1], b.shape[1]
    if out is not None:
        _check_tensor(out, "out", op)
        _check_dtype(out, "out", op, _WGRAD_DTYPES)
        if tuple(out.shape) != (groups, n, k) or not out.is_contiguous():
            raise ValueError("%s: out must be a contiguous [groups, N, K] = [%d, %d, %d] tensor, "
                             "got shape %s" % (op, groups, n, k, tuple(out.shape)))
    elif out_dtype not in _WGRAD_DTYPES:
        raise TypeError("%s: out_dtype must be torch.bfloat16 or torch.float32, got %r"
                        % (op, out_dtype))
    _check_cuda(a, "a", op, None)
    _check_cuda(b, "b", op, a.device)
    _check_cuda(offsets, "offsets", op, a.device)
    if out is not None:
        _check_cuda(out, "out", op, a.device)


def _launch_wgrad(a, b, offsets, out):
    op = "tilewire.grouped_gemm_wgrad"
    m, n = a.shape
    groups, k = out.shape[0], b.shape[1]
    if groups == 0 or n == 0 or k == 0:
        return
    if m == 0:
        out.zero_()  # every group is empty
        return
    for t, name in ((a, "a"), (b, "b"), (out, "out")):
        _check_aligned(t, name, op)
    size = ctypes.c_size_t(0)
    _lib.call("tw_grouped_gemm_wgrad_workspace_size", m, n, k, ctypes.byref(size), comm=False)
    workspace = torch.empty(max(size.value, 16), dtype=torch.uint8, device=a.device)
    args = _lib.GroupedGemmArgs(
        c_dtype=_lib.DType.BF16 if out.dtype == bf16 else _lib.DType.FP32,
        a=a.data_ptr(), b=b.data_ptr(), out=out.data_ptr(), offsets=offsets.data_ptr(),
        m=m, n=n, k=k, groups=groups, lda=a.stride(0) if m > 1 else n,
        ldb=b.stride(0) if m > 1 else k, ldo=k,
    )
    with _on_device(a.device.index):  # the kernels run on the current device
        _lib.call("tw_grouped_gemm_wgrad", ctypes.byref(args), workspace.data_ptr(),
                  workspace.numel(), _stream(a.device), comm=False)


@_custom_op("tilewire::grouped_gemm_wgrad_out", mutates_args=("out",))
def _wgrad_out_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                  out: torch.Tensor) -> None:
    _launch_wgrad(a, b, offsets, out)


@_register_fake(_wgrad_out_op)
def _wgrad_out_fake(a, b, offsets, out):
    return None


def grouped_gemm_wgrad(a, b, offsets, out=None, out_dtype=torch.bfloat16):
    """The grouped GEMM's weight gradient (tw_grouped_gemm_wgrad; an MoE layer's expert weight
    gradients): ``out[g] = a[rows of g].T @ b[rows of g]`` for every group g, the rows
    ``offsets[g] <= r < offsets[g + 1]`` as tilewire.grouped_gemm takes them.

    a: bf16 [M, N] (the gradient of the grouped GEMM's out), b: bf16 [M, K] (the grouped GEMM's
    a), rows contiguous with a row stride a multiple of 8 elements, N and K multiples of 8;
    offsets: int32 CUDA tensor [groups + 1] (multiples of 128, offsets[groups] <= M), read on the
    device only. Every row of a group counts, its padding rows too: each must be zero in a or
    in b and finite in the other. out: contiguous [groups, N, K], bf16 or fp32 (allocated in
    out_dtype when None); an empty group's is zeros. fp32 accumulation, bitwise repeatable. On
    torch's current stream, CUDA-graph capturable. Returns out.
    """
    _check_wgrad(a, b, offsets, out, out_dtype)
    if out is None:
        out = torch.empty((offsets.numel() - 1, a.shape[1], b.shape[1]), dtype=out_dtype,
                          device=a.device)
    if _HAVE_CUSTOM_OP:
        torch.ops.tilewire.grouped_gemm_wgrad_out(a, b, offsets, out)
    else:
        _launch_wgrad(a, b, offsets, out)
    return out


# ---- grouped_gemm's autograd --------------------------------------------------------------


# _ops' tw_grouped_gemm launcher (register_grouped_gemm_autograd), for a torch without
# custom ops (with them the backward goes through torch.ops.tilewire.grouped_gemm_out)
_launch_grouped = None


def _grouped_out(a, b, offsets, out):
    """tilewire.grouped_gemm(a, b, offsets, out=out), the arguments known good."""
    if _HAVE_CUSTOM_OP:
        torch.ops.tilewire.grouped_gemm_out(a, b, offsets, out)
    else:
        _launch_grouped(a, b, offsets, out)


def _grouped_forward_grads(a, b, offsets, d_out, need_a, need_b):
    """(d_a, d_b) of out = grouped_gemm(a, b, offsets): d_a's rows of no group are zero."""
    d_out = d_out.to(bf16).contiguous()
    d_a = d_b = None
    if need_a:
        d_a = torch.zeros(a.shape, dtype=a.dtype, device=a.device)
        # group g's [K, N]: d_a = d_out @ b[g]
        _grouped_out(d_out, b.transpose(1, 2).contiguous(), offsets, d_a)
    if need_b:
        d_b = grouped_gemm_wgrad(d_out, a, offsets, out_dtype=b.dtype)
    return d_a, d_b


def _grouped_setup(ctx, inputs, output):
    a, b, offsets, _ = inputs
    ctx.save_for_backward(a, b, offsets)


def _grouped_backward(ctx, d_out):
    a, b, offsets = ctx.saved_tensors
    d_a, d_b = _grouped_forward_grads(a, b, offsets, d_out, ctx.needs_input_grad[0],
                                      ctx.needs_input_grad[1])
    return d_a, d_b, None, None


def register_grouped_gemm_autograd(op, launch):
    """Makes torch.ops.tilewire.grouped_gemm (tilewire.grouped_gemm without `out`)
    differentiable in a and b; launch: _ops' tw_grouped_gemm launcher."""
    global _launch_grouped
    _launch_grouped = launch
    if _HAVE_CUSTOM_OP:
        op.register_autograd(_grouped_backward, setup_context=_grouped_setup)


# ---- moe_combine_backward -----------------------------------------------------------------


def _combine_backward(comm, grad, topk_idx, topk_weights, expert_out, workspace, expert_grad,
                      max_tokens, experts, want_weights):
    """tw_moe_combine_backward: writes expert_grad (every rank's rows of its tokens' slots,
    each expert's padding rows zeroed); returns weights_grad fp32 [tokens, top_k] (None when
    not wanted)."""
    op = "tilewire.moe_combine_backward"
    _need_symmetric(op, comm, expert_out, "expert_out")
    _need_symmetric(op, comm, expert_grad, "expert_grad")
    grad = grad.to(bf16).contiguous()
    weights_grad = None
    if want_weights:
        weights_grad = torch.empty(topk_idx.shape, dtype=torch.float32, device=grad.device)
    args = _moe_args(op, comm, topk_idx, workspace, max_tokens, experts, expert_out.shape[0],
                     (("grad", grad), ("expert_out", expert_out),
                      ("expert_grad", expert_grad)))
    args.topk_weights, args.expert_out = _ptr(topk_weights), expert_out.data_ptr()
    args.n_out, args.grad, args.expert_grad = expert_out.shape[1], _ptr(grad), \
        expert_grad.data_ptr()
    args.weights_grad = None if weights_grad is None else _ptr(weights_grad)
    _lib.call("tw_moe_combine_backward", comm.handle, ctypes.byref(args), _stream(grad.device))
    return weights_grad


def _check_grad_buffer(op, comm, t, name, rows, cols):
    if t is None:
        raise ValueError("%s: %s is needed for the backward (a symmetric bf16 [%d, %d] tensor "
                         "from comm.empty) when an input requires grad" % (op, name, rows, cols))
    _check_tensor(t, name, op)
    _check_dtype(t, name, op, (bf16,))
    if tuple(t.shape) != (rows, cols) or not t.is_contiguous():
        raise ValueError("%s: %s must be a contiguous [%d, %d] tensor, got shape %s"
                         % (op, name, rows, cols, tuple(t.shape)))
    _need_symmetric(op, comm, t, name)


def _dispatch_backward(comm, d_recv, topk_idx, workspace, grad_buffer, max_tokens, experts,
                       tokens):
    """d_x [tokens, hidden] of the dispatch: every token's rows of d_recv summed (the combine
    with weights 1), d_recv copied into the symmetric grad_buffer first unless it is it."""
    if d_recv.data_ptr() != grad_buffer.data_ptr():
        grad_buffer.copy_(d_recv)
    ones = torch.ones(topk_idx.shape, dtype=torch.float32, device=grad_buffer.device)
    d_x = torch.empty((tokens, grad_buffer.shape[1]), dtype=bf16, device=grad_buffer.device)
    _combine_impl(comm.id, grad_buffer, topk_idx, ones, workspace, d_x, max_tokens, experts)
    return d_x


def _swiglu_backward(h, d_act):
    """(d_gate | d_up) of act = silu(gate) * up, in fp32, as bf16 [rows, 2 inter]."""
    inter = d_act.shape[1]
    g, u, d = h[:, :inter].float(), h[:, inter:].float(), d_act.float()
    s = torch.sigmoid(g)
    d_g = d * u * s * (1 + g * (1 - s))
    return torch.cat((d_g, d * g * s), dim=1).to(bf16)


class _Spec:
    """What an MoE autograd node keeps of its call besides the differentiable tensors."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


class MoeCombineFn(torch.autograd.Function):
    """out = moe_combine(expert_out, topk_weights); backward: moe_combine_backward."""

    @staticmethod
    def forward(ctx, expert_out, topk_weights, spec):
        _combine_impl(spec.comm.id, expert_out, spec.topk_idx, topk_weights, spec.workspace,
                      spec.out, spec.max_tokens, spec.experts)
        ctx.spec = spec
        ctx.save_for_backward(topk_weights)
        return spec.out.detach()

    @staticmethod
    def backward(ctx, d_out):
        s = ctx.spec
        (topk_weights,) = ctx.saved_tensors
        weights_grad = _combine_backward(s.comm, d_out, s.topk_idx, topk_weights, s.expert_out,
                                         s.workspace, s.expert_grad, s.max_tokens, s.experts,
                                         ctx.needs_input_grad[1])
        return s.expert_grad.detach(), weights_grad, None


class MoeDispatchFn(torch.autograd.Function):
    """recv = moe_dispatch(x); backward: the combine of d_recv with weights 1."""

    @staticmethod
    def forward(ctx, x, spec):
        _dispatch_impl(spec.comm.id, x, spec.topk_idx, spec.recv, spec.offsets, spec.workspace,
                       spec.max_tokens, spec.experts)
        ctx.spec, ctx.tokens = spec, x.shape[0]
        return spec.recv.detach()

    @staticmethod
    def backward(ctx, d_recv):
        s = ctx.spec
        return _dispatch_backward(s.comm, d_recv, s.topk_idx, s.workspace, s.grad_buffer,
                                  s.max_tokens, s.experts, ctx.tokens), None


def _gemm_dispatch_backward(spec, d_out, weights, need_x, need_w, tokens):
    """(d_x, d_weights) of out = grouped_gemm(moe_dispatch(x), weights, offsets), the
    dispatch's recv, offsets and routing in spec: d_weights = grouped_gemm_wgrad(d_out, recv)
    (None unless need_w); d_recv = grouped_gemm(d_out, weights[e].T) into spec.grad_buffer,
    then the dispatch's backward (None unless need_x). d_out: the gradient of out, every row
    of a group finite (the GEMMs read it all)."""
    d_out = d_out.to(bf16).contiguous()
    d_w = grouped_gemm_wgrad(d_out, spec.recv, spec.offsets, out_dtype=weights.dtype) \
        if need_w else None
    d_x = None
    if need_x:
        buf = spec.grad_buffer
        _grouped_out(d_out, weights.transpose(1, 2).contiguous(), spec.offsets, buf)
        d_x = _dispatch_backward(spec.comm, buf, spec.topk_idx, spec.workspace, buf,
                                 spec.max_tokens, spec.experts, tokens)
    return d_x, d_w


class MoeDispatchGemmFn(torch.autograd.Function):
    """expert_out = moe_dispatch_gemm(x, weights); backward: _gemm_dispatch_backward."""

    @staticmethod
    def forward(ctx, x, weights, spec):
        _gemm_dispatch_impl(spec.comm.id, x, spec.topk_idx, weights, spec.recv,
                            spec.expert_out, spec.offsets, spec.workspace, spec.max_tokens,
                            spec.experts)
        ctx.spec, ctx.tokens = spec, x.shape[0]
        ctx.save_for_backward(weights)
        return spec.expert_out.detach()

    @staticmethod
    def backward(ctx, d_expert_out):
        (weights,) = ctx.saved_tensors
        d_x, d_w = _gemm_dispatch_backward(ctx.spec, d_expert_out, weights,
                                           ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                                           ctx.tokens)
        return d_x, d_w, None


class MoeFfnFn(torch.autograd.Function):
    """out = moe_ffn(x, topk_weights, w13, w2); backward: the module docstring's chain."""

    @staticmethod
    def forward(ctx, x, topk_weights, w13, w2, spec):
        _ffn_impl(spec.comm.id, x, spec.topk_idx, topk_weights, w13, w2, spec.recv,
                  spec.offsets, spec.h, spec.act, spec.expert_out, spec.workspace, spec.out,
                  spec.max_tokens, spec.experts)
        ctx.spec, ctx.tokens = spec, x.shape[0]
        ctx.save_for_backward(topk_weights, w13, w2)
        return spec.out.detach()

    @staticmethod
    def backward(ctx, d_out):
        s = ctx.spec
        topk_weights, w13, w2 = ctx.saved_tensors
        need_x, need_w, need_w13, need_w2 = ctx.needs_input_grad[:4]
        buf = s.grad_buffer
        weights_grad = _combine_backward(s.comm, d_out, s.topk_idx, topk_weights, s.expert_out,
                                         s.workspace, buf, s.max_tokens, s.experts, need_w)
        # the down projection (expert_out = act @ w2[e].T): d_act and d_w2
        d_act, d_w2 = _grouped_forward_grads(s.act, w2, s.offsets, buf, True, need_w2)
        d_h = _swiglu_backward(s.h, d_act)
        # the gate/up projection (h = recv @ w13[e].T) and the dispatch: d_recv into buf (the
        # combine's gradient rows are no longer read: the GEMMs above ran first in stream
        # order)
        d_x, d_w13 = _gemm_dispatch_backward(s, d_h, w13, need_x, need_w13, ctx.tokens)
        return d_x, weights_grad, d_w13, d_w2, None


def needs_grad(*tensors):
    """Whether autograd records a call on these tensors (None entries ignored)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
