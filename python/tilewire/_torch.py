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

The modules, each importing only those above it:

    _symmetric   symmetric tensors over a comm's memory (no other module of the package but
                 _dlpack, so _comm imports it for Comm.empty)
    _glue        custom-op registration, torch's current stream and device, argument checks
    _eager       how an eager call reaches the library: dispatcher, direct path, fast lane
    _torchrun    tilewire.init
    _ops         gemm, grouped_gemm, allgather, barrier, for_each_rank
    _fused       ag_gemm, gemm_rs, gemm_ar and their backward passes
    _moe_grad    grouped_gemm_wgrad, the backward passes of grouped_gemm and the MoE ops
    _attention_grad
                 the attention ops' backward custom ops, the ring's symmetric grad buffers
    _attention   attention (single-GPU attention), ring_attention, their autograd Functions
    _moe         moe_dispatch, moe_combine, moe_dispatch_gemm, moe_ffn, swiglu, moe_workspace,
                 moe_recv_rows
"""

from ._attention import (
    attention,
    ring_attention,
    ring_attention_grad_buffers,
    ring_attention_reserve,
)
from ._fused import ag_gemm, gemm_ar, gemm_rs, gemm_rs_workspace
from ._moe import (
    moe_combine,
    moe_dispatch,
    moe_dispatch_gemm,
    moe_ffn,
    moe_recv_rows,
    moe_workspace,
    swiglu,
)
from ._async_tp import (
    comm_for_group,
    fused_all_gather_matmul,
    fused_matmul_reduce_scatter,
    register_group,
    release_async_tp_buffers,
)
from ._moe_grad import grouped_gemm_wgrad
from ._ops import allgather, barrier, for_each_rank, gemm, grouped_gemm
from ._symmetric import comm_empty, is_symmetric, symmetric_empty
from ._torchrun import init, init_mesh

__all__ = [
    "ag_gemm",
    "allgather",
    "attention",
    "ring_attention",
    "ring_attention_grad_buffers",
    "ring_attention_reserve",
    "barrier",
    "comm_empty",
    "comm_for_group",
    "for_each_rank",
    "fused_all_gather_matmul",
    "fused_matmul_reduce_scatter",
    "gemm",
    "gemm_ar",
    "gemm_rs",
    "gemm_rs_workspace",
    "grouped_gemm",
    "grouped_gemm_wgrad",
    "init",
    "init_mesh",
    "is_symmetric",
    "moe_combine",
    "moe_dispatch",
    "moe_dispatch_gemm",
    "moe_ffn",
    "moe_recv_rows",
    "moe_workspace",
    "register_group",
    "release_async_tp_buffers",
    "swiglu",
    "symmetric_empty",
]

# ---- the next ops: add each as it lands in tilewire.h -------------------------------------
#
# Checklist per op (ag_gemm in _fused.py is the template): _lib.FUNCTIONS and the args struct
# in _lib.STRUCTS; the struct in python/tools/struct_layout.c; a _check_<op> function, a
# mutating custom op with register_fake, and the public function (in _fused.py, or a module of
# its own importing the same layers); its import and __all__ entry here; its name in
# __init__._TORCH_NAMES; a GPU test against the torch reference in python/tests/test_gpu_*.py.
