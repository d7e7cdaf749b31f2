"""torch async-TP's fused ops with their signatures, over tilewire's: an async-TP user switches
with one line (torch.ops.symm_mem.fused_all_gather_matmul -> tilewire.fused_all_gather_matmul,
the same for fused_matmul_reduce_scatter). The group is a tilewire Comm, or the name of a
torch.distributed group that tilewire.init(group=...) (or register_group) tied to one.

The symmetric buffers the ops need (the gathered A, the reduce-scatter's workspace) are made
collectively on a call whose shapes are new and kept on the comm for the later calls (every
rank calls alike, as the torch ops require); release_async_tp_buffers drops them. Autograd
records the calls as ag_gemm's and gemm_rs's; a second call of the same shape overwrites the
gathered A that the first call's backward reads, so run that backward first."""

import torch

from ._comm import Comm
from ._fused import ag_gemm, gemm_rs, gemm_rs_workspace

__all__ = ["fused_all_gather_matmul", "fused_matmul_reduce_scatter", "register_group",
           "comm_for_group", "release_async_tp_buffers"]

_BF16 = torch.bfloat16
_GROUPS = {}  # torch group name -> tilewire Comm
_ATTR = "_tw_async_tp_buffers"  # on the comm: {key: symmetric tensor}, gone with the comm


def register_group(group, comm):
    """Ties a torch.distributed group (or its name) to a tilewire Comm of the same ranks, for
    the group_name argument of the ops below. tilewire.init(group=...) registers its own."""
    name = group if isinstance(group, str) else getattr(group, "group_name", None)
    if not isinstance(name, str):
        raise TypeError("tilewire.register_group: expected a torch.distributed group or its "
                        "name, got %r" % (group,))
    _GROUPS[name] = comm
    return comm


def comm_for_group(group_name, op="tilewire.comm_for_group"):
    """The tilewire Comm of group_name: a Comm itself, or a registered torch group's name."""
    if isinstance(group_name, Comm) or (hasattr(group_name, "rank") and
                                        hasattr(group_name, "size") and
                                        hasattr(group_name, "empty")):
        return group_name
    name = group_name if isinstance(group_name, str) else getattr(group_name, "group_name", None)
    comm = _GROUPS.get(name)
    if comm is None:
        raise ValueError("%s: no tilewire comm for group %r; create it with "
                         "tilewire.init(group=...) or tie one with tilewire.register_group "
                         "(registered: %s)" % (op, group_name, sorted(_GROUPS) or "none"))
    return comm


def release_async_tp_buffers(comm=None):
    """Drops the ops' buffers of comm (None: of every registered group's comm); the buffers
    also go with their comm. Collective: every rank alike."""
    for c in (list(_GROUPS.values()) if comm is None else [comm]):
        if hasattr(c, _ATTR):
            delattr(c, _ATTR)


def _buffer(comm, key, make):
    bufs = getattr(comm, _ATTR, None)
    if bufs is None:
        bufs = {}
        setattr(comm, _ATTR, bufs)
    buf = bufs.get(key)
    if buf is None:
        buf = bufs[key] = make()
    return buf


def _check(op, t, name, dim=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError("%s: %s must be a tensor, got %s" % (op, name, type(t).__name__))
    if t.dtype != _BF16:
        raise TypeError("%s: %s is %s; tilewire's fused ops take torch.bfloat16"
                        % (op, name, t.dtype))
    if dim is not None and t.dim() != dim:
        raise ValueError("%s: %s must be %d-D, got shape %s" % (op, name, dim, tuple(t.shape)))


def _dim(op, d, ndim, name):
    if isinstance(d, bool) or not isinstance(d, int) or not -ndim <= d < ndim:
        raise ValueError("%s: %s=%r is outside the tensor's %d dims" % (op, name, d, ndim))
    return d % ndim


def fused_all_gather_matmul(A_shard, Bs, gather_dim, group_name, *, return_A=True):
    """torch.ops.symm_mem.fused_all_gather_matmul's contract on tilewire.ag_gemm: A = the
    all-gather of A_shard along gather_dim over the group's ranks (in rank order); returns (A
    or None, [A @ B for B in Bs]).

    A_shard: bf16 [..., K] (gather_dim any dim but the last); Bs: bf16 [K, N_i] each (one
    fused call over their concatenated columns). The result's tensors are new. Collective:
    every rank calls it with the same shapes. The all-gather along the last dim (torch's
    K-gathering case) is not served (ValueError)."""
    op = "tilewire.fused_all_gather_matmul"
    comm = comm_for_group(group_name, op)
    _check(op, A_shard, "A_shard")
    if A_shard.dim() < 2:
        raise ValueError("%s: A_shard must be at least 2-D, got shape %s"
                         % (op, tuple(A_shard.shape)))
    d = _dim(op, gather_dim, A_shard.dim(), "gather_dim")
    if d == A_shard.dim() - 1:
        raise ValueError("%s: gather_dim=%d is A_shard's last (K) dim; tilewire gathers rows "
                         "(any other dim)" % (op, gather_dim))
    Bs = list(Bs)
    if not Bs:
        raise ValueError("%s: Bs is empty" % op)
    k = A_shard.shape[-1]
    for i, b in enumerate(Bs):
        _check(op, b, "Bs[%d]" % i, 2)
        if b.shape[0] != k:
            raise ValueError("%s: Bs[%d] is %s; expected [K=%d, N]" % (op, i, tuple(b.shape), k))
    world = comm.size
    lead = A_shard.shape[:-1]
    m_local = 1
    for s in lead:
        m_local *= s
    a = A_shard.reshape(m_local, k).contiguous()
    widths = [b.shape[1] for b in Bs]
    b_t = torch.cat([b.t() for b in Bs], dim=0).contiguous()  # [sum N, K]: ag_gemm's b
    gathered = _buffer(comm, ("ag", world * m_local, k),
                       lambda: comm.empty((world * m_local, k), _BF16))
    out = ag_gemm(comm, a, b_t, gathered)  # [world * m_local, sum N], rank-major rows

    def placed(rows, cols):
        """rank-major rows [world * m_local, cols] as the gather along d: [..., world * s_d,
        ..., cols]."""
        t = rows.reshape(world, *lead, cols)
        t = t.movedim(0, d)
        return t.reshape(*lead[:d], world * lead[d], *lead[d + 1:], cols).contiguous()

    res, at = [], 0
    for w in widths:
        res.append(placed(out[:, at:at + w], w))
        at += w
    A = placed(gathered[:world * m_local], k) if return_A else None
    return A, res


def fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name):
    """torch.ops.symm_mem.fused_matmul_reduce_scatter's contract on tilewire.gemm_rs: the
    reduce-scatter over the group's ranks of A @ B along scatter_dim (this rank's part, in
    rank order), reduce_op "sum" or "avg".

    A: bf16 [..., K] (this rank's columns), B: bf16 [K, N]; scatter_dim any dim but the last,
    its size a multiple of the world. Collective. Returns a new tensor."""
    op = "tilewire.fused_matmul_reduce_scatter"
    comm = comm_for_group(group_name, op)
    _check(op, A, "A")
    _check(op, B, "B", 2)
    if A.dim() < 2:
        raise ValueError("%s: A must be at least 2-D, got shape %s" % (op, tuple(A.shape)))
    if reduce_op not in ("sum", "avg"):
        raise ValueError("%s: reduce_op must be 'sum' or 'avg', got %r" % (op, reduce_op))
    d = _dim(op, scatter_dim, A.dim(), "scatter_dim")
    if d == A.dim() - 1:
        raise ValueError("%s: scatter_dim=%d is A's last (K) dim" % (op, scatter_dim))
    world, k = comm.size, A.shape[-1]
    if B.shape[0] != k:
        raise ValueError("%s: B is %s; expected [K=%d, N]" % (op, tuple(B.shape), k))
    if A.shape[d] % world:
        raise ValueError("%s: A.shape[%d]=%d must be a multiple of world=%d"
                         % (op, d, A.shape[d], world))
    n = B.shape[1]
    moved = A.movedim(d, 0)  # the scattered dim first: each rank's part is a block of rows
    lead = moved.shape[:-1]
    m = moved.numel() // k
    a = moved.reshape(m, k).contiguous()
    ws = None
    if world > 1:
        ws = _buffer(comm, ("rs", m, n), lambda: gemm_rs_workspace(comm, m, n))
    out = gemm_rs(comm, a, B.t().contiguous(), ws)  # [m / world, n]
    if reduce_op == "avg":
        out = out / world
    part = out.reshape(lead[0] // world, *lead[1:], n)
    return part.movedim(0, d).contiguous()
