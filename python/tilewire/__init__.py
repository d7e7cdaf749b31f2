"""tilewire: persistent CUDA kernels for Hopper that fuse multi-GPU communication with the
compute it feeds. Python front end over libtilewire.so (include/tilewire.h).

Without torch: the ctypes binding (``tilewire._lib``), errors, configs, comms and raw
symmetric memory::

    comms = tilewire.init_virtual(4)          # 4 virtual ranks on GPU 0
    ptr = comms[0].alloc(1 << 20)             # collective, like tw_mem_alloc

With torch (imported on first use of these names): ``init``, ``gemm``, ``grouped_gemm``,
``grouped_gemm_wgrad``, ``allgather``, ``ag_gemm``, ``gemm_rs``, ``gemm_ar``,
``gemm_rs_workspace``, ``moe_dispatch``, ``moe_combine``, ``moe_dispatch_gemm``, ``moe_ffn``,
``swiglu``, ``moe_workspace``, ``moe_recv_rows``, ``attention``, ``ring_attention``,
``ring_attention_grad_buffers``, ``ring_attention_reserve``, ``barrier``, ``for_each_rank``, ``symmetric_empty``,
``is_symmetric``, and ``Comm.empty(shape, dtype)`` for symmetric tensors::

    comm = tilewire.init()                    # under torchrun
    out = comm.empty((comm.size * m, k), torch.bfloat16)
    tilewire.allgather(comm, x, out)
    y = tilewire.gemm(a, b)                   # a @ b.T
    y = tilewire.grouped_gemm(x, w, offsets)  # x[rows of g] @ w[g].T per group g

``tilewire.nn`` (torch too): ``ColumnParallelLinear`` and ``RowParallelLinear``, torch.nn
modules over ag_gemm / gemm_rs / gemm_ar, ``ExpertParallelMoE`` over moe_ffn with its plain
PyTorch twin ``TorchMoE``, and ``RingAttention`` over ring_attention (also as
``tilewire.ColumnParallelLinear``, ...).
"""

from . import _lib
from ._comm import Comm, get_unique_id, init_rank, init_virtual
from ._errors import (
    AbortedError,
    BootstrapTimeoutError,
    CudaError,
    DeviceTimeoutError,
    InternalError,
    InvalidArgumentError,
    MismatchError,
    NetworkError,
    NoDeviceError,
    NotSupportedError,
    OutOfMemoryError,
    RemoteError,
    Status,
    SystemCallError,
    TilewireError,
    UnsupportedDeviceError,
)
from ._lib import (
    AgGemmArgs,
    AttentionArgs,
    AttentionBackwardArgs,
    Config,
    DType,
    GemmArgs,
    GemmRsArgs,
    GroupedGemmArgs,
    LibraryNotFoundError,
    MoeArgs,
    TileOrder,
    UniqueId,
    env_knobs,
    library_path,
)
from ._lib import transport_info
from ._lib import version as library_version

# The header's version: include/tilewire.h TW_VERSION_*, which _lib mirrors (python/tests check
# the mirror against the header, and tilewire.library_version() against the loaded library).
__version__ = "%d.%d.%d" % (_lib.TW_VERSION_MAJOR, _lib.TW_VERSION_MINOR, _lib.TW_VERSION_PATCH)

# Names that need torch: resolved from tilewire._torch on first access.
_TORCH_NAMES = (
    "init",
    "init_mesh",
    "gemm",
    "grouped_gemm",
    "grouped_gemm_wgrad",
    "allgather",
    "barrier",
    "for_each_rank",
    "symmetric_empty",
    "is_symmetric",
    # fused ops
    "ag_gemm",
    "gemm_rs",
    "gemm_ar",
    "gemm_rs_workspace",
    # MoE expert parallelism inside a node
    "moe_dispatch",
    "moe_combine",
    "moe_dispatch_gemm",
    "moe_ffn",
    "swiglu",
    "moe_workspace",
    "moe_recv_rows",
    # torch async-TP's fused ops, with their signatures
    "fused_all_gather_matmul",
    "fused_matmul_reduce_scatter",
    "register_group",
    "comm_for_group",
    "release_async_tp_buffers",
    # attention: single-GPU and ring (context-parallel), forward and backward
    "attention",
    "ring_attention",
    "ring_attention_grad_buffers",
    "ring_attention_reserve",
    # ---- add each new op's name here as it lands
)

# torch.nn modules of tilewire.nn (needs torch): resolved from it on first access.
_NN_NAMES = ("ColumnParallelLinear", "RowParallelLinear", "ExpertParallelMoE", "TorchMoE",
             "RingAttention")

__all__ = [
    "AbortedError",
    "MismatchError",
    "NetworkError",
    "AgGemmArgs",
    "AttentionArgs",
    "AttentionBackwardArgs",
    "BootstrapTimeoutError",
    "Comm",
    "Config",
    "CudaError",
    "DType",
    "DeviceTimeoutError",
    "GemmArgs",
    "GemmRsArgs",
    "GroupedGemmArgs",
    "InternalError",
    "InvalidArgumentError",
    "LibraryNotFoundError",
    "MoeArgs",
    "NoDeviceError",
    "NotSupportedError",
    "OutOfMemoryError",
    "RemoteError",
    "Status",
    "SystemCallError",
    "TileOrder",
    "TilewireError",
    "UniqueId",
    "UnsupportedDeviceError",
    "env_knobs",
    "get_unique_id",
    "init_rank",
    "init_virtual",
    "library_path",
    "library_version",
    "transport_info",
    *_TORCH_NAMES,
    "nn",
    *_NN_NAMES,
]


def __getattr__(name):
    if name in _TORCH_NAMES:
        try:
            from . import _torch
        except ImportError as e:
            raise ImportError(
                "tilewire.%s needs PyTorch (%s); install torch, or use the torch-free API "
                "(tilewire.init_virtual, Comm.alloc, tilewire._lib)" % (name, e)
            ) from e
        value = getattr(_torch, name)
        globals()[name] = value
        return value
    if name == "nn" or name in _NN_NAMES:
        import importlib

        try:  # not `from . import nn`: that asks this __getattr__ for "nn" again
            _nn = importlib.import_module(__name__ + ".nn")
        except ImportError as e:
            raise ImportError("tilewire.%s needs PyTorch (%s)" % (name, e)) from e
        value = _nn if name == "nn" else getattr(_nn, name)
        globals()[name] = value
        return value
    raise AttributeError("module 'tilewire' has no attribute %r" % name)


def __dir__():
    return sorted(set(globals()) | set(_TORCH_NAMES) | {"nn", *_NN_NAMES})
