"""tilewire.nn: tensor-parallel linear layers over the fused ops (Megatron-LM semantics, the
sequence-parallel style, since the ops are AllGather + GEMM and GEMM + ReduceScatter), and the
expert-parallel MoE layer ``ExpertParallelMoE`` over tilewire.moe_ffn with ``TorchMoE``, the
plain PyTorch layer whose state_dict it loads and gives back (python/tilewire/_nn_moe.py), and
the context-parallel ``RingAttention`` over tilewire.ring_attention (forward and backward;
python/tilewire/_nn_attention.py).

``ColumnParallelLinear`` (tilewire.ag_gemm) takes this rank's rows of the input and gives
every row of its column shard; ``RowParallelLinear`` (tilewire.gemm_rs or gemm_ar) takes
the column shard and gives this rank's rows of the sum (reduce="scatter") or all of it
(reduce="all"). The MLP of tensor parallelism::

    comm = tilewire.init()                                   # one rank per process
    fc1 = tilewire.nn.ColumnParallelLinear(h, f, comm=comm)
    fc2 = tilewire.nn.RowParallelLinear(f, h, comm=comm)
    y = fc2(torch.nn.functional.gelu(fc1(x)))                # x, y: this rank's rows

Each layer is a torch.nn.Module holding its rank's shard of the weight and bias, under the
keys "weight" and "bias" of torch.nn.Linear (sharded). ``from_linear`` makes a rank's layer
from a full torch.nn.Linear; ``full_state_dict`` / ``to_linear`` rebuild the full layer
from every rank's shards; load_state_dict takes a shard's state_dict or a full
torch.nn.Linear's (this rank keeps its shard).

Initialisation: reset_parameters draws the full weight and bias as torch.nn.Linear does
(kaiming_uniform_(a=sqrt(5)), bias uniform in +-1/sqrt(in_features)) in fp32 on the CPU,
from a torch.Generator seeded with the constructor's ``init_seed`` (the values of
``torch.manual_seed(init_seed); torch.nn.Linear(in_features, out_features, bias)``), so that
every rank builds the same full matrix and keeps its shard. The default seed is 0 for every
layer: give the layers of a model distinct seeds (the layer's index, say), or two layers of
one shape start equal.

Buffers: a layer owns the symmetric buffers its op needs (ColumnParallelLinear: the gathered
input, and the gradient's reduce-scatter workspace when the input requires grad;
RowParallelLinear: the op's workspace), allocated collectively (comm.empty) on the first
forward that needs them and reallocated, larger, when a larger input comes. Construction
allocates nothing and calls no library function. For CUDA graph capture and torch.compile,
call ``reserve(rows)`` first (every rank, the largest input) so that forward allocates
nothing. Buffers outgrown are kept until ``release_buffers()``: freeing symmetric memory is
collective and synchronises the device, which must happen only where no rank has a
collective in flight (with virtual ranks: after torch.cuda.synchronize(), no backward
pending).

Autograd comes from the ops: ColumnParallelLinear's backward is a GEMM + ReduceScatter for
the input's gradient and a local GEMM on the gathered input for the weight's; with
reduce="scatter" RowParallelLinear's is an AllGather + GEMM, with reduce="all" it is local
(the all-reduce's backward is the identity, as in Megatron). Bias gradients are plain torch.
With reduce="scatter", each rank's RowParallelLinear bias gradient covers only its rows:
the full gradient is the sum over ranks (all-reduce it, as Megatron does for the
sequence-parallel parameters). A ColumnParallelLinear's gathered input is saved for its
backward: a second forward of the same layer before the backward overwrites it (autograd
then reports a tensor modified in place).
"""

import math

import torch
from torch import nn

from ._fused import _weight_grad, ag_gemm, gemm_ar, gemm_rs, gemm_rs_workspace, warm_backward
from ._glue import _positive_int, _world_and_rank
from ._nn_attention import RingAttention
from ._nn_moe import ExpertParallelMoE, TorchMoE, full_moe_init

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "full_linear_init", "RingAttention",
           "ExpertParallelMoE", "TorchMoE", "full_moe_init"]

_BF16 = torch.bfloat16


def full_linear_init(in_features, out_features, bias=True, init_seed=0):
    """The full fp32 CPU weight [out_features, in_features] and bias [out_features] (None
    without bias) that the layers' reset_parameters take their shards of: torch.nn.Linear's
    initialisation drawn (weight first) from a torch.Generator seeded with init_seed, the
    values of ``torch.manual_seed(init_seed); torch.nn.Linear(in_features, out_features)``."""
    gen = torch.Generator().manual_seed(int(init_seed))
    weight = torch.empty(out_features, in_features)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=gen)
    if not bias:
        return weight, None
    bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
    b = torch.empty(out_features)
    nn.init.uniform_(b, -bound, bound, generator=gen)
    return weight, b


def _nbytes(t):
    return 0 if t is None else t.numel() * t.element_size()


class _ParallelLinear(nn.Module):
    """What both layers share: the shards, their initialisation and the state_dict."""

    _split_dim = 0  # the dim of the full weight split over ranks
    _bias_split = True  # whether the bias is split too (else every rank holds all of it)

    def __init__(self, in_features, out_features, bias, comm, dtype, device, init_seed):
        super().__init__()
        op = "tilewire.nn." + type(self).__name__
        _positive_int(in_features, "in_features", op)
        _positive_int(out_features, "out_features", op)
        world, rank = _world_and_rank(comm, op)
        name = "out_features" if self._split_dim == 0 else "in_features"
        split = out_features if self._split_dim == 0 else in_features
        if split % world:
            raise ValueError("%s: %s=%d must be divisible by world=%d (each rank holds %s / "
                             "world of the weight)" % (op, name, split, world, name))
        self.comm, self.world, self.rank = comm, world, rank
        self.in_features, self.out_features = in_features, out_features
        self.init_seed = int(init_seed)
        if device is None:
            device = torch.device("cuda", getattr(comm, "device", 0))
        factory = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(self._shard_shape("weight"), **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(self._shard_shape("bias"), **factory))
        else:
            self.register_parameter("bias", None)
        self._tw_retired = []  # outgrown symmetric buffers, kept until release_buffers()
        self.reset_parameters()

    # ---- shards -----------------------------------------------------------------------

    def _full_shape(self, name):
        if name == "weight":
            return (self.out_features, self.in_features)
        return (self.out_features,)

    def _split(self, name):
        """The dim of the full tensor `name` split over ranks, or None."""
        if name == "weight":
            return self._split_dim
        return 0 if self._bias_split else None

    def _shard_shape(self, name):
        shape = list(self._full_shape(name))
        dim = self._split(name)
        if dim is not None:
            shape[dim] //= self.world
        return tuple(shape)

    def _shard_of(self, name, full):
        dim = self._split(name)
        if dim is None:
            return full
        size = full.shape[dim] // self.world
        return full.narrow(dim, self.rank * size, size)

    def reset_parameters(self):
        """torch.nn.Linear's initialisation of the full layer (full_linear_init, seeded with
        init_seed: the same on every rank), of which this rank keeps its shard."""
        if self.weight.is_meta:
            return
        weight, bias = full_linear_init(self.in_features, self.out_features,
                                        self.bias is not None, self.init_seed)
        with torch.no_grad():
            self.weight.copy_(self._shard_of("weight", weight))
            if self.bias is not None:
                self.bias.copy_(self._shard_of("bias", bias))

    # ---- state_dict -------------------------------------------------------------------

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        """Takes this rank's shard of a full torch.nn.Linear's tensors (told by shape)."""
        for name in ("weight", "bias"):
            key = prefix + name
            param = getattr(self, name)
            value = state_dict.get(key)
            if param is None or not isinstance(value, torch.Tensor):
                continue
            shape = tuple(value.shape)
            if shape == tuple(param.shape):
                continue
            if shape == self._full_shape(name):
                state_dict[key] = self._shard_of(name, value)
                continue
            raise ValueError(
                "tilewire.nn.%s: state_dict key %r has shape %s; expected this rank's shard %s "
                "or the full torch.nn.Linear's %s (world=%d)"
                % (type(self).__name__, key, shape, tuple(param.shape), self._full_shape(name),
                   self.world))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    @classmethod
    def from_linear(cls, linear, comm, **kwargs):
        """This rank's layer holding its shard of a full torch.nn.Linear's weight and bias
        (cast to dtype, torch.bfloat16 by default). kwargs: the constructor's."""
        if not isinstance(linear, nn.Linear):
            raise TypeError("%s.from_linear: expected a torch.nn.Linear, got %s"
                            % (cls.__name__, type(linear).__name__))
        device = kwargs.pop("device", None)
        if device is None:
            device = torch.device("cuda", getattr(comm, "device", 0))
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    comm=comm, device="meta", **kwargs)
        layer = layer.to_empty(device=device)
        layer.load_state_dict(linear.state_dict())
        return layer

    @classmethod
    def full_state_dict(cls, shards):
        """The full torch.nn.Linear's state_dict from every rank's layer or its state_dict,
        in rank order (virtual ranks of one process): the shards concatenated."""
        shards = list(shards)
        dicts = []
        for r, s in enumerate(shards):
            if isinstance(s, nn.Module):
                if not isinstance(s, cls):
                    raise TypeError("%s.full_state_dict: shard %d is a %s"
                                    % (cls.__name__, r, type(s).__name__))
                if s.rank != r or s.world != len(shards):
                    raise ValueError("%s.full_state_dict: shard %d is rank %d of %d; pass "
                                     "every rank's layer in rank order"
                                     % (cls.__name__, r, s.rank, s.world))
                s = s.state_dict()
            dicts.append(s)
        if not dicts:
            raise ValueError("%s.full_state_dict: no shards" % cls.__name__)
        device = dicts[0]["weight"].device
        out = {"weight": torch.cat([d["weight"].detach().to(device) for d in dicts],
                                   dim=cls._split_dim)}
        if dicts[0].get("bias") is not None:
            if cls._bias_split:
                out["bias"] = torch.cat([d["bias"].detach().to(device) for d in dicts])
            else:  # every rank holds all of it: rank 0's
                out["bias"] = dicts[0]["bias"].detach().clone()
        return out

    @classmethod
    def to_linear(cls, shards):
        """The full torch.nn.Linear (dtype and device of the shards) from every rank's layer
        or state_dict, in rank order."""
        state = cls.full_state_dict(shards)
        weight = state["weight"]
        out_features, in_features = weight.shape
        linear = nn.Linear(in_features, out_features, bias="bias" in state, device="meta",
                           dtype=weight.dtype)
        linear = linear.to_empty(device=weight.device)
        linear.load_state_dict(state)
        return linear

    def extra_repr(self):
        return "in_features=%d, out_features=%d, bias=%s, world=%d, rank=%d" % (
            self.in_features, self.out_features, self.bias is not None, self.world, self.rank)

    # ---- buffers and inputs -----------------------------------------------------------

    def _grown(self, attr, nbytes, make):
        """The symmetric buffer `attr`, reallocated (make(), collective) when it has fewer
        than nbytes bytes; the outgrown one is kept until release_buffers()."""
        buf = getattr(self, attr, None)
        if buf is not None and _nbytes(buf) >= nbytes:
            return buf
        if buf is not None:
            self._tw_retired.append(buf)
        buf = make()
        object.__setattr__(self, attr, buf)
        return buf

    def release_buffers(self):
        """Drops the symmetric buffers (collective: every rank, in the same order, where no
        collective is in flight); the next forward allocates again."""
        for attr in self._buffer_attrs:
            object.__setattr__(self, attr, None)
        self._tw_retired.clear()

    def _operand(self, x, features):
        """x [rows, ..., features] as the op's bf16 [rows * ..., features] operand."""
        op = "tilewire.nn." + type(self).__name__
        if self.weight.dtype != _BF16:
            raise TypeError("%s: the fused ops need torch.bfloat16 weights, this layer's are "
                            "%s (build it with dtype=torch.bfloat16, or .to(torch.bfloat16))"
                            % (op, self.weight.dtype))
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-1] != features:
            raise ValueError("%s: the input must be a tensor [rows, ..., %d], got %s"
                             % (op, features, tuple(x.shape) if isinstance(x, torch.Tensor)
                                else type(x).__name__))
        return x.reshape(-1, features).to(_BF16).contiguous()


class ColumnParallelLinear(_ParallelLinear):
    """Column-parallel linear layer over tilewire.ag_gemm: y = x @ weight.T + bias, with the
    weight's rows (out_features) split over the comm's ranks.

    Holds weight [out_features / world, in_features] and bias [out_features / world] (this
    rank's shard). forward(x): x is this rank's rows [m_local, ..., in_features] of the
    input (sequence parallelism: rank r holds rows [r * m_local, (r + 1) * m_local)); returns
    every rank's rows of this rank's output columns, [world * m_local, ..., out_features /
    world], in rank order (bf16). Collective: every rank calls it with the same shapes.

    gather_output=True (the full output on every rank) is not supported yet. device: the
    parameters' (default: the comm's CUDA device); dtype: torch.bfloat16, what the op takes
    (another dtype builds, but forward raises). init_seed: see reset_parameters.
    """

    _split_dim = 0
    _bias_split = True
    _buffer_attrs = ("_tw_gathered", "_tw_grad_workspace")

    def __init__(self, in_features, out_features, bias=True, *, comm, dtype=_BF16, device=None,
                 gather_output=False, init_seed=0):
        if gather_output:
            raise NotImplementedError(
                "tilewire.nn.ColumnParallelLinear: gather_output=True is not supported yet; the "
                "layer returns this rank's columns [world * m_local, out_features / world] "
                "(feed them to a RowParallelLinear, as in Megatron's MLP)")
        super().__init__(in_features, out_features, bias, comm, dtype, device, init_seed)
        self.gather_output = False
        self._tw_gathered = self._tw_grad_workspace = None

    def reserve(self, rows, grad=False):
        """Allocates (collectively) the buffers for inputs of up to `rows` rows of this rank
        (x.numel() // in_features); grad=True: also the input gradient's workspace, and the
        backward's weight-gradient matmul made once at `rows` (warm_backward: on virtual
        ranks a first cuBLAS call inside the ranks' loop could wait forever)."""
        self._gathered(_positive_int(rows, "rows", "ColumnParallelLinear.reserve"))
        if grad:
            self._grad_workspace(rows)
            m, n, k, dev = self.world * rows, self.weight.shape[0], self.in_features, \
                self.weight.device
            warm_backward(lambda: _weight_grad(torch.zeros(m, n, dtype=_BF16, device=dev),
                                               torch.zeros(m, k, dtype=_BF16, device=dev)), dev)

    def _gathered(self, rows):
        k = self.in_features
        return self._grown("_tw_gathered", self.world * rows * k * 2,
                           lambda: self.comm.empty((self.world * rows, k), _BF16))

    def _grad_workspace(self, rows):
        if self.world == 1:
            return None
        m, k = self.world * rows, self.in_features
        return self._grown("_tw_grad_workspace", self.comm.gemm_rs_workspace_size(m, k),
                           lambda: gemm_rs_workspace(self.comm, m, k))

    def forward(self, x):
        a = self._operand(x, self.in_features)
        rows = a.shape[0]
        gathered = self._gathered(rows)
        grad_ws = None
        if torch.is_grad_enabled() and a.requires_grad:
            grad_ws = self._grad_workspace(rows)
        out = ag_gemm(self.comm, a, self.weight, gathered, grad_workspace=grad_ws)
        if self.bias is not None:
            out = out + self.bias
        return out.view(self.world * x.shape[0], *x.shape[1:-1], self.weight.shape[0])


class RowParallelLinear(_ParallelLinear):
    """Row-parallel linear layer over tilewire.gemm_rs / gemm_ar: y = x @ weight.T + bias,
    with the weight's columns (in_features) split over the comm's ranks.

    Holds weight [out_features, in_features / world] (this rank's shard) and the full bias
    [out_features] (the same on every rank, added once, after the reduction). forward(x): x
    is this rank's columns [M, ..., in_features / world] (a ColumnParallelLinear's output);
    reduce="scatter" (tilewire.gemm_rs) returns this rank's rows of the sum, [M / world, ...,
    out_features]; reduce="all" (tilewire.gemm_ar) all of it, [M, ..., out_features] on every
    rank. M must be a multiple of world. Collective.

    input_is_parallel=False (a full input, split here) is not supported yet. dtype, device,
    init_seed: as ColumnParallelLinear's.
    """

    _split_dim = 1
    _bias_split = False
    _buffer_attrs = ("_tw_workspace",)

    def __init__(self, in_features, out_features, bias=True, *, comm, dtype=_BF16, device=None,
                 input_is_parallel=True, reduce="scatter", init_seed=0):
        if not input_is_parallel:
            raise NotImplementedError(
                "tilewire.nn.RowParallelLinear: input_is_parallel=False is not supported yet; "
                "pass this rank's columns [M, in_features / world] (a ColumnParallelLinear's "
                "output)")
        if reduce not in ("scatter", "all"):
            raise ValueError("tilewire.nn.RowParallelLinear: reduce must be 'scatter' "
                             "(tilewire.gemm_rs) or 'all' (tilewire.gemm_ar), got %r" % (reduce,))
        super().__init__(in_features, out_features, bias, comm, dtype, device, init_seed)
        self.input_is_parallel, self.reduce = True, reduce
        self._tw_workspace = None

    def reserve(self, rows, grad=False):
        """Allocates (collectively) the workspace for inputs of up to `rows` rows
        (x.numel() // (in_features / world)); grad=True: also the backward's torch matmuls
        made once at `rows` (warm_backward: on virtual ranks a first cuBLAS call inside the
        ranks' loop could wait forever)."""
        self._workspace(_positive_int(rows, "rows", "RowParallelLinear.reserve"))
        if not grad:
            return
        n, k, dev = self.out_features, self.weight.shape[1], self.weight.device
        local_grad_a = self.reduce != "scatter" or self.world == 1  # else through ag_gemm

        def matmuls():
            g = torch.zeros(rows, n, dtype=_BF16, device=dev)
            _weight_grad(g, torch.zeros(rows, k, dtype=_BF16, device=dev))
            if local_grad_a:
                torch.matmul(g, self.weight.detach().to(_BF16))
        warm_backward(matmuls, dev)

    def _workspace(self, rows):
        if self.world == 1:
            return None
        n = self.out_features
        return self._grown("_tw_workspace", self.comm.gemm_rs_workspace_size(rows, n),
                           lambda: gemm_rs_workspace(self.comm, rows, n))

    def forward(self, x):
        a = self._operand(x, self.weight.shape[1])
        scatter = self.reduce == "scatter"
        if x.shape[0] % self.world:
            raise ValueError("tilewire.nn.RowParallelLinear: x.shape[0]=%d must be a multiple "
                             "of world=%d" % (x.shape[0], self.world))
        op = gemm_rs if scatter else gemm_ar
        out = op(self.comm, a, self.weight, self._workspace(a.shape[0]))
        if self.bias is not None:
            out = out + self.bias
        rows = x.shape[0] // self.world if scatter else x.shape[0]
        return out.view(rows, *x.shape[1:-1], self.out_features)

    def extra_repr(self):
        return super().extra_repr() + ", reduce=%r" % self.reduce
