"""Symmetric tensors: torch tensors over a comm's tw_mem_alloc memory, viewed through DLPack.

This module imports torch and, of this package, only _dlpack: it takes any comm with
``alloc``, ``_allocs`` and ``device`` (a tilewire.Comm), so that _comm can import it on first
use of Comm.empty without the two importing each other.
"""

import math

import torch

from . import _dlpack

# torch dtype -> DLPack (code, bits)
DLPACK_DTYPES = {
    torch.bfloat16: (_dlpack.KDL_BFLOAT, 16),
    torch.float16: (_dlpack.KDL_FLOAT, 16),
    torch.float32: (_dlpack.KDL_FLOAT, 32),
    torch.float64: (_dlpack.KDL_FLOAT, 64),
    torch.int8: (_dlpack.KDL_INT, 8),
    torch.int16: (_dlpack.KDL_INT, 16),
    torch.int32: (_dlpack.KDL_INT, 32),
    torch.int64: (_dlpack.KDL_INT, 64),
    torch.uint8: (_dlpack.KDL_UINT, 8),
}


def _shape(shape):
    if isinstance(shape, int):
        shape = (shape,)
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError("shape: %s has a negative dimension" % (shape,))
    return shape


def comm_empty(comm, shape, dtype=None):
    """Comm.empty: a tensor over a fresh tw_mem_alloc allocation (collective).

    The tensor (and every view of it) keeps the allocation; when the last one dies the
    allocation is freed with tw_mem_free, which is collective too: ranks must drop their
    symmetric tensors in the same order, which they do when they run the same program. A
    free synchronises the device (once every rank of the process freed it), so keep
    symmetric tensors long-lived; frees of tensors that die during a CUDA graph capture are
    deferred to the next alloc or close. comm.close() frees whatever is still alive.
    """
    dtype = torch.bfloat16 if dtype is None else dtype
    if not isinstance(dtype, torch.dtype):
        raise TypeError("dtype: expected a torch.dtype, got %r" % (dtype,))
    if dtype not in DLPACK_DTYPES:
        raise TypeError(
            "dtype: %s is not supported for symmetric tensors (supported: %s)"
            % (dtype, ", ".join(str(d) for d in DLPACK_DTYPES))
        )
    shape = _shape(shape)
    code, bits = DLPACK_DTYPES[dtype]
    nbytes = math.prod(shape) * (bits // 8)
    # Every rank asks for the same size, so a zero-size tensor still takes a small slot.
    ptr = comm.alloc(max(nbytes, 16))
    alloc = comm._allocs[ptr]
    capsule, address = _dlpack.export(ptr, shape, code, bits, _dlpack.KDL_CUDA, comm.device,
                                      on_release=alloc.release)
    try:
        return torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        _dlpack.release(address)
        raise


def symmetric_empty(comms, shape, dtype=None):
    """comm.empty(shape, dtype) for each comm of a virtual-rank group, in rank order (one
    thread makes the collective allocation for every rank)."""
    return [c.empty(shape, dtype) for c in comms]


def is_symmetric(comm, t):
    """True when tensor t lies inside a live symmetric allocation of comm."""
    nbytes = t.numel() * t.element_size()
    return comm.find_allocation(t.data_ptr(), max(nbytes, 1)) is not None
