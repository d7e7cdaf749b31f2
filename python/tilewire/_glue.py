"""torch glue every op of the front end uses: registering custom ops (on a torch that has
them), torch's current stream and device, and the argument checks.

The checks read metadata only (type, dtype, shape, strides, device), so they also run on
torch.compile's fake tensors and on CPU and meta tensors; each raises a TypeError or
ValueError naming the op and the argument. The data-pointer check (_check_aligned) needs real
tensors and runs at launch.
"""

import ctypes

import torch

from ._comm import Comm

_HAVE_CUSTOM_OP = hasattr(torch.library, "custom_op") and hasattr(torch.library, "register_fake")


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
    """The cudaStream_t of torch's current stream on `device` (a torch.device with an index),
    through torch's raw accessor where it has one (what torch's own compiled kernels use; it
    costs far less host time than torch.cuda.current_stream)."""
    if _raw_stream is not None and device.index is not None:
        return ctypes.c_void_p(_raw_stream(device.index))
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


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


# ---- argument checks (metadata only: they also run on torch.compile's fake tensors) -------


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


# The output dtypes of the GEMM-based ops (tw_dtype_t TW_BF16 and TW_FP32).
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


def _check_comm(comm, op):
    if not isinstance(comm, Comm):
        raise TypeError("%s: comm must be a tilewire.Comm, got %s" % (op, type(comm).__name__))
    if comm.closed:
        raise ValueError("%s: comm is closed" % op)


# ---- the torch.nn modules' checks (tilewire.nn, _nn_moe) ------------------------------------


def _positive_int(value, name, op):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("%s: %s must be a positive int, got %r" % (op, name, value))
    return value


def _world_and_rank(comm, op):
    """comm's (size, rank): a tilewire.Comm, or anything with them (the host tests' fakes)."""
    size, rank = getattr(comm, "size", None), getattr(comm, "rank", None)
    if not isinstance(size, int) or not isinstance(rank, int) or not 0 <= rank < size:
        raise TypeError("%s: comm must be a tilewire.Comm (with .rank and .size), got %r"
                        % (op, comm))
    return size, rank
