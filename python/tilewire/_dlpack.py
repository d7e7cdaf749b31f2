"""A minimal DLPack producer: wraps memory tilewire owns (symmetric-heap allocations) as a
DLPack capsule, so torch (or numpy, for host memory) views it without a copy, and calls back
when the consumer's last view dies.

torch.from_dlpack(capsule) stores the DLManagedTensor and calls its deleter when the storage
is freed; the deleter here drops the registry entry and runs the owner's `on_release`. No
numpy and no compiled extension needed; the layout is DLPack's stable ABI (dlpack.h, v0.x
"dltensor" capsules, which torch and numpy both accept).
"""

import ctypes
import threading

# DLDeviceType
KDL_CPU = 1
KDL_CUDA = 2

# DLDataTypeCode
KDL_INT = 0
KDL_UINT = 1
KDL_FLOAT = 2
KDL_BFLOAT = 4
KDL_BOOL = 6


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _Deleter),
]

_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

_live = {}  # address of the DLManagedTensor -> _Export (keeps it and its arrays alive)
_live_lock = threading.Lock()


class _Export:
    __slots__ = ("managed", "shape", "strides", "on_release")

    def __init__(self, managed, shape, strides, on_release):
        self.managed = managed
        self.shape = shape
        self.strides = strides
        self.on_release = on_release


def release(address):
    """Runs the owner's on_release for the export at `address`, once (idempotent)."""
    with _live_lock:
        export = _live.pop(address, None)
    if export is not None and export.on_release is not None:
        export.on_release()


def _deleter(managed_ptr):
    # Called by the consumer (possibly from another thread; ctypes takes the GIL).
    try:
        release(ctypes.cast(managed_ptr, ctypes.c_void_p).value)
    except Exception:  # noqa: BLE001 - nothing may escape into C
        pass


_DELETER = _Deleter(_deleter)  # kept alive for the life of the module


def live_exports():
    """How many exported views have not been released yet."""
    with _live_lock:
        return len(_live)


def capsule(ptr, shape, code, bits, device_type, device_id, on_release=None, strides=None):
    """A "dltensor" capsule over `ptr`. `shape`/`strides` in elements (strides None: packed
    row-major). on_release() runs when the consumer releases the tensor (or when the capsule
    is dropped unconsumed and `release(address)` is called, see export())."""
    capsule_, _ = export(ptr, shape, code, bits, device_type, device_id, on_release, strides)
    return capsule_


def export(ptr, shape, code, bits, device_type, device_id, on_release=None, strides=None):
    """Like capsule(), also returning the registry address for an explicit release() if the
    capsule is never consumed."""
    ndim = len(shape)
    shape_arr = (ctypes.c_int64 * max(ndim, 1))(*shape)
    strides_arr = None
    if strides is not None:
        if len(strides) != ndim:
            raise ValueError("strides: %d entries for %d dimensions" % (len(strides), ndim))
        strides_arr = (ctypes.c_int64 * max(ndim, 1))(*strides)
    managed = DLManagedTensor()
    t = managed.dl_tensor
    t.data = ptr
    t.device = DLDevice(device_type, device_id)
    t.ndim = ndim
    t.dtype = DLDataType(code, bits, 1)
    t.shape = ctypes.cast(shape_arr, ctypes.POINTER(ctypes.c_int64))
    if strides_arr is not None:
        t.strides = ctypes.cast(strides_arr, ctypes.POINTER(ctypes.c_int64))
    t.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = _DELETER
    address = ctypes.addressof(managed)
    with _live_lock:
        _live[address] = _Export(managed, shape_arr, strides_arr, on_release)
    return _PyCapsule_New(address, b"dltensor", None), address


class Exporter:
    """An object with __dlpack__/__dlpack_device__ over one capsule (for numpy.from_dlpack
    and other consumers that want the protocol rather than a raw capsule)."""

    def __init__(self, capsule_, device_type, device_id):
        self._capsule = capsule_
        self._device = (device_type, device_id)

    def __dlpack__(self, stream=None, **_ignored):
        if self._capsule is None:
            raise RuntimeError("this DLPack export was already consumed")
        c, self._capsule = self._capsule, None
        return c

    def __dlpack_device__(self):
        return self._device
