"""The launches of the MoE ops (tilewire.h): each fills a tw_moe_args_t from the tensors (the
pointers checked 16-byte aligned, the symmetric ones checked symmetric) and calls the library
on torch's current stream. Below _moe (the public functions and custom ops) and _moe_grad
(the backward passes), which both call them."""

import ctypes

import torch

from . import _lib
from ._comm import comm_by_id
from ._glue import _check_aligned, _on_device, _stream
from ._symmetric import is_symmetric



def _ptr(t):
    return t.data_ptr() if t.numel() else None


def _need_symmetric(op, comm, t, name):
    if not is_symmetric(comm, t):
        raise ValueError("%s: %s must be a symmetric tensor of rank %d's comm (from comm.empty)"
                         % (op, name, comm.rank))


def _moe_args(op, comm, topk_idx, workspace, max_tokens, experts, recv_rows, aligned):
    """The args struct's routing fields, the pointers checked first (real tensors only)."""
    for name, t in aligned:
        if t is not None:
            _check_aligned(t, name, op)
    _need_symmetric(op, comm, workspace, "workspace")
    tokens, top_k = topk_idx.shape
    return _lib.MoeArgs(
        index_bits=32 if topk_idx.dtype == torch.int32 else 64, topk_idx=_ptr(topk_idx),
        workspace=workspace.data_ptr(), tokens=tokens, max_tokens=max_tokens, experts=experts,
        top_k=top_k, recv_rows=recv_rows,
    )


def _dispatch_impl(comm_id, x, topk_idx, recv, offsets, workspace, max_tokens, experts,
                   weights=None, expert_out=None):
    gemm = weights is not None
    op = "tilewire.moe_dispatch_gemm" if gemm else "tilewire.moe_dispatch"
    comm = comm_by_id(comm_id)
    _need_symmetric(op, comm, recv, "recv")
    args = _moe_args(op, comm, topk_idx, workspace, max_tokens, experts, recv.shape[0],
                     (("x", x), ("recv", recv), ("weights", weights),
                      ("expert_out", expert_out)))
    args.x, args.recv, args.offsets = _ptr(x), recv.data_ptr(), offsets.data_ptr()
    args.hidden = x.shape[1]
    if gemm:
        args.weights, args.expert_out = weights.data_ptr(), expert_out.data_ptr()
        args.n_out = weights.shape[1]
    _lib.call("tw_moe_dispatch_gemm" if gemm else "tw_moe_dispatch", comm.handle,
              ctypes.byref(args), _stream(x.device))
    return args


def _combine_impl(comm_id, expert_out, topk_idx, topk_weights, workspace, out, max_tokens,
                  experts):
    op = "tilewire.moe_combine"
    comm = comm_by_id(comm_id)
    _need_symmetric(op, comm, expert_out, "expert_out")
    args = _moe_args(op, comm, topk_idx, workspace, max_tokens, experts, expert_out.shape[0],
                     (("expert_out", expert_out), ("out", out)))
    args.expert_out, args.out = expert_out.data_ptr(), _ptr(out)
    args.topk_weights, args.n_out = _ptr(topk_weights), expert_out.shape[1]
    _lib.call("tw_moe_combine", comm.handle, ctypes.byref(args), _stream(expert_out.device))
    return args


def _gemm_dispatch_impl(comm_id, x, topk_idx, weights, recv, expert_out, offsets, workspace,
                        max_tokens, experts):
    """_dispatch_impl in the custom op's argument order."""
    return _dispatch_impl(comm_id, x, topk_idx, recv, offsets, workspace, max_tokens, experts,
                          weights, expert_out)


def _ffn_impl(comm_id, x, topk_idx, topk_weights, w13, w2, recv, offsets, h, act, expert_out,
              workspace, out, max_tokens, experts):
    op = "tilewire.moe_ffn"
    comm = comm_by_id(comm_id)
    _need_symmetric(op, comm, recv, "recv")
    _need_symmetric(op, comm, expert_out, "expert_out")
    args = _moe_args(op, comm, topk_idx, workspace, max_tokens, experts, recv.shape[0],
                     (("x", x), ("recv", recv), ("w13", w13), ("w2", w2), ("h", h),
                      ("act", act), ("expert_out", expert_out), ("out", out)))
    args.x, args.recv, args.offsets = _ptr(x), recv.data_ptr(), offsets.data_ptr()
    args.topk_weights, args.out = _ptr(topk_weights), _ptr(out)
    args.weights, args.weights2 = w13.data_ptr(), w2.data_ptr()
    args.h, args.act, args.expert_out = h.data_ptr(), act.data_ptr(), expert_out.data_ptr()
    args.hidden, args.inter = x.shape[1], w2.shape[2]  # n_out is not read
    _lib.call("tw_moe_ffn", comm.handle, ctypes.byref(args), _stream(x.device))
    return args


def _swiglu_impl(h, out):
    op = "tilewire.swiglu"
    rows, inter = out.shape
    if rows == 0:
        return  # nothing to compute
    _check_aligned(h, "h", op)
    _check_aligned(out, "out", op)
    with _on_device(h.device.index):  # tw_swiglu runs on the current device
        _lib.call("tw_swiglu", h.data_ptr(), out.data_ptr(), rows, inter, _stream(h.device),
                  comm=False)
