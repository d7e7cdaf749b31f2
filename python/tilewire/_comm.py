"""Comms (tw_comm_t) and the symmetric heap, without torch.

``init_virtual(world)`` makes virtual ranks sharing one GPU (tw_comm_init_all);
``init_rank(world, rank, unique_id)`` joins one rank of a multi-process group
(tw_comm_init_rank; ``tilewire.init()`` does this under torchrun). A Comm's symmetric tensors
come from ``comm.empty(shape, dtype)`` (torch) or raw pointers from ``comm.alloc(bytes)``.
"""

import atexit
import ctypes
import itertools
import os
import threading
import warnings
import weakref

from . import _lib
from ._errors import Status, error_for

_ids = itertools.count(1)
_registry = {}  # comm id -> Comm, for custom ops that take the comm as an int
_registry_lock = threading.Lock()


def comm_by_id(comm_id):
    """The open Comm whose ``.id`` is comm_id (custom ops carry comms as ints)."""
    try:
        return _registry[comm_id]
    except KeyError:
        raise ValueError("comm id %d: no open tilewire Comm has it (closed?)" % comm_id) from None


def _config(config=None, **overrides):
    cfg = _lib.Config() if config is None else _lib.Config.from_buffer_copy(config)
    for name, value in overrides.items():
        if value is not None:
            setattr(cfg, name, value)
    return cfg


def _device_index(device):
    """An int from an int, a torch.device or a "cuda:N" string."""
    if device is None:
        return 0
    if isinstance(device, int):
        return device
    index = getattr(device, "index", None)
    if index is not None or hasattr(device, "type"):
        return 0 if index is None else int(index)
    text = str(device)
    if text.startswith("cuda:"):
        text = text[5:]
    elif text == "cuda":
        return 0
    try:
        return int(text)
    except ValueError:
        raise ValueError("device: %r is not a CUDA device index" % (device,)) from None


class _Allocation:
    """One tw_mem_alloc allocation of a comm; freed once, by whichever comes first: the
    death of its last tensor (deleter), Comm.free, or Comm.close."""

    __slots__ = ("comm_ref", "ptr", "nbytes", "live", "__weakref__")

    def __init__(self, comm, ptr, nbytes):
        self.comm_ref = weakref.ref(comm)
        self.ptr = ptr
        self.nbytes = nbytes
        self.live = True

    def release(self):
        """Called when the last tensor over this memory dies."""
        if not self.live:
            return
        comm = self.comm_ref()
        if comm is None or comm.closed:
            self.live = False
            return
        comm._release(self)


class Comm:
    """One rank of a tilewire communicator (tw_comm_t).

    Ranks, world, node layout and SM budget are read once at creation. Use as a context
    manager or call ``close()``; comms still open at interpreter exit are closed then.
    A comm may be used by one host thread at a time (as in C).
    """

    def __init__(self, handle, *, virtual=False):
        if not handle:
            raise ValueError("Comm: NULL handle")
        self._handle = ctypes.c_void_p(handle)
        self.virtual = virtual
        self.id = next(_ids)
        self._allocs = {}  # ptr -> _Allocation
        # bumped whenever an allocation is made or freed: the eager fast lane (_eager.py) keys
        # its "this tensor is symmetric" answers on it
        self.alloc_generation = 0
        self._ws_sizes = {}  # (m, n) -> tw_gemm_rs_workspace_size
        self._moe_ws_sizes = {}  # (max_tokens, hidden, experts, top_k) -> tw_moe_workspace_size
        self._pending_frees = []  # allocations whose tensors died during CUDA graph capture
        self._stream = None
        self.rank = self._query("tw_comm_rank")
        self.size = self._query("tw_comm_size")
        self.device = self._query("tw_comm_device")
        self.local_rank = self._query("tw_comm_local_rank")
        self.local_size = self._query("tw_comm_local_size")
        self.node = self._query("tw_comm_node")
        self.nodes = self._query("tw_comm_nodes")
        self.sm_budget = self._query("tw_comm_sm_budget")
        with _registry_lock:
            _registry[self.id] = self

    # ---- queries ------------------------------------------------------------------------

    @property
    def stream(self):
        """With virtual ranks: this rank's own torch.cuda.Stream (made on first use), on which
        tilewire.for_each_rank issues its calls; None for a process-per-rank comm."""
        if self._stream is None and self.virtual:
            import torch

            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    @property
    def world(self):
        return self.size

    @property
    def handle(self):
        """The tw_comm_t as a ctypes.c_void_p (for calling _lib functions directly)."""
        self._check_open()
        return self._handle

    @property
    def closed(self):
        return self._handle is None

    def _check_open(self):
        if self._handle is None:
            raise ValueError("comm: closed")

    def _query(self, name):
        value = ctypes.c_int()
        _lib.call(name, self._handle, ctypes.byref(value))
        return value.value

    @property
    def last_error(self):
        """tw_comm_last_error: the message of the last failed call on this comm."""
        self._check_open()
        return _lib._text(_lib.function("tw_comm_last_error")(self._handle))

    def async_error(self):
        """Errors recorded by kernels (tw_comm_async_error), without synchronising: None, or
        the TilewireError (DeviceTimeoutError / AbortedError, not raised) naming rank, op,
        flag, expected and seen. A comm that saw one is unusable: close it."""
        self._check_open()
        status = _lib.c_enum()
        _lib.call("tw_comm_async_error", self._handle, ctypes.byref(status))
        if status.value == Status.SUCCESS:
            return None
        return error_for(status.value, self.last_error, "tw_comm_async_error")

    def check_async(self):
        """Raises async_error() if there is one."""
        err = self.async_error()
        if err is not None:
            raise err

    # ---- symmetric heap -------------------------------------------------------------------

    def alloc(self, nbytes):
        """Collective tw_mem_alloc: this rank's device pointer (an int) to `nbytes` bytes.
        Every rank calls it, in the same order, with the same size (with virtual ranks, one
        thread calls it for each comm in turn). Free with ``free(ptr)``."""
        self._check_open()
        nbytes = int(nbytes)
        self._flush_pending()
        ptr = ctypes.c_void_p()
        _lib.call("tw_mem_alloc", self._handle, ctypes.c_size_t(nbytes), ctypes.byref(ptr))
        alloc = _Allocation(self, ptr.value, nbytes)
        self._allocs[ptr.value] = alloc
        self.alloc_generation += 1
        return ptr.value

    def free(self, ptr):
        """tw_mem_free of a pointer from ``alloc``. Collective, like alloc. Synchronises the
        device once every rank of this process has freed it (do not call during capture)."""
        self._check_open()
        alloc = self._allocs.get(int(ptr))
        if alloc is None:
            raise ValueError("ptr: %#x is not a live allocation of this comm" % int(ptr))
        self._free(alloc)

    def _free(self, alloc):
        alloc.live = False
        self._allocs.pop(alloc.ptr, None)
        self.alloc_generation += 1
        _lib.call("tw_mem_free", self._handle, ctypes.c_void_p(alloc.ptr))

    def _release(self, alloc):
        # From a tensor's deleter: no exception may escape, and tw_mem_free's device
        # synchronisation must not happen inside a CUDA graph capture.
        try:
            if _capturing():
                self._pending_frees.append(alloc)
                return
            self._free(alloc)
        except Exception as e:  # noqa: BLE001 - a deleter cannot raise
            warnings.warn("tilewire: freeing a symmetric tensor failed: %s" % e, RuntimeWarning)

    def _flush_pending(self):
        pending, self._pending_frees = self._pending_frees, []
        for alloc in pending:
            if alloc.live:
                self._free(alloc)

    def flush_frees(self):
        """Frees the symmetric tensors that died during a CUDA graph capture (done anyway at
        the next alloc/empty and at close)."""
        self._check_open()
        self._flush_pending()

    def live_allocations(self):
        """(ptr, bytes) of every allocation not yet freed."""
        return [(a.ptr, a.nbytes) for a in self._allocs.values() if a.live]

    def find_allocation(self, ptr, nbytes=1):
        """The (base, bytes) of the live allocation holding [ptr, ptr + nbytes), or None."""
        ptr = int(ptr)
        for a in self._allocs.values():
            if a.live and a.ptr <= ptr and ptr + nbytes <= a.ptr + a.nbytes:
                return a.ptr, a.nbytes
        return None

    def peer_ptr(self, ptr, peer):
        """tw_mem_peer_ptr: peer's copy of symmetric pointer `ptr`, usable in this rank's
        kernels (an int)."""
        self._check_open()
        out = ctypes.c_void_p()
        _lib.call("tw_mem_peer_ptr", self._handle, ctypes.c_void_p(int(ptr)), int(peer),
                  ctypes.byref(out))
        return out.value

    def peer_ptrs(self, ptr):
        """tw_mem_peer_ptrs: device address of the array of `world` peer pointers of the
        allocation based at `ptr` (an int)."""
        self._check_open()
        out = ctypes.c_void_p()
        _lib.call("tw_mem_peer_ptrs", self._handle, ctypes.c_void_p(int(ptr)), ctypes.byref(out))
        return out.value

    def gemm_rs_workspace_size(self, m, n):
        """tw_gemm_rs_workspace_size: bytes of symmetric workspace tw_gemm_rs / tw_gemm_ar
        need on this comm for an m x n product."""
        self._check_open()
        key = (int(m), int(n))
        size = self._ws_sizes.get(key)
        if size is None:  # asked on every call by the torch front end: cached per shape
            out = ctypes.c_size_t()
            _lib.call("tw_gemm_rs_workspace_size", self._handle, key[0], key[1],
                      ctypes.byref(out))
            size = self._ws_sizes[key] = out.value
        return size

    def moe_workspace_size(self, max_tokens, experts, top_k, hidden=0):
        """tw_moe_workspace_size: bytes of symmetric workspace tw_moe_dispatch /
        tw_moe_combine / tw_moe_dispatch_gemm need on this comm (hidden: the widest row the
        calls move; read across nodes only)."""
        self._check_open()
        key = (int(max_tokens), int(hidden), int(experts), int(top_k))
        size = self._moe_ws_sizes.get(key)
        if size is None:  # asked on every call by the torch front end: cached per shape
            out = ctypes.c_size_t()
            _lib.call("tw_moe_workspace_size", self._handle, key[0], key[1], key[2], key[3],
                      ctypes.byref(out))
            size = self._moe_ws_sizes[key] = out.value
        return size

    def empty(self, shape, dtype=None):
        """A torch tensor of `shape` and `dtype` (default bfloat16) in symmetric memory
        (collective, like alloc). Its memory is freed (tw_mem_free) when the last tensor
        viewing it dies, or at close(). Needs torch (tilewire._symmetric)."""
        from . import _symmetric

        return _symmetric.comm_empty(self, shape, dtype)

    # ---- lifetime -------------------------------------------------------------------------

    def close(self):
        """tw_comm_destroy. Frees every symmetric allocation still live: tensors still
        viewing them must not be used afterwards (a warning says how many there were)."""
        self._close(warn=True)

    def _close(self, warn):
        if self._handle is None:
            return
        live = [a for a in self._allocs.values() if a.live]
        pending = [a for a in self._pending_frees if a.live]
        if warn and len(live) > len(pending):
            warnings.warn(
                "tilewire: closing rank %d's comm with %d symmetric allocation(s) still "
                "referenced; their memory is freed now and tensors over it must not be used"
                % (self.rank, len(live) - len(pending)),
                RuntimeWarning,
                stacklevel=3,
            )
        for a in live:
            a.live = False
        self._allocs.clear()
        self.alloc_generation += 1
        self._pending_frees = []
        handle, self._handle = self._handle, None
        with _registry_lock:
            _registry.pop(self.id, None)
        _lib.call("tw_comm_destroy", handle, comm=False)  # handle is gone: tw_last_error

    destroy = close

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        if self.closed:
            return "<tilewire.Comm id=%d closed>" % self.id
        return (
            "<tilewire.Comm rank %d of %d, device %d, node %d of %d, local rank %d of %d, "
            "sm_budget %d%s>"
            % (self.rank, self.size, self.device, self.node, self.nodes, self.local_rank,
               self.local_size, self.sm_budget, ", virtual" if self.virtual else "")
        )


def _capturing():
    """True while the current CUDA stream is being captured (torch loaded only)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except Exception:  # noqa: BLE001 - a half-initialised torch: assume not capturing
        return False


@atexit.register
def _close_all():
    with _registry_lock:
        comms = sorted(_registry.values(), key=lambda c: -c.id)
    for comm in comms:
        try:
            comm._close(warn=False)  # tensors alive at exit are normal, not a mistake
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


# ---- creating comms ---------------------------------------------------------------------


def get_unique_id():
    """tw_get_unique_id: 128 bytes to hand to every rank (starts the bootstrap root in this
    process, which must stay alive until the ranks have met)."""
    uid = _lib.UniqueId()
    _lib.call("tw_get_unique_id", ctypes.byref(uid))
    return bytes(uid)


def init_rank(world, rank, unique_id, config=None, *, sm_budget=None):
    """tw_comm_init_rank: joins the group of `world` ranks meeting at `unique_id` (bytes from
    get_unique_id on one rank) as `rank`, on the current CUDA device."""
    uid = _lib.UniqueId.from_bytes(unique_id)
    cfg = _config(config, sm_budget=sm_budget)
    handle = ctypes.c_void_p()
    _lib.call("tw_comm_init_rank", ctypes.byref(handle), int(world), uid, int(rank),
              ctypes.byref(cfg))
    return Comm(handle.value)


# What a process of virtual ranks sharing a GPU needs when CUDA starts. Ranks spin on each
# other's flags inside their kernels: under lazy module loading (CUDA's default) the first launch
# of a kernel not yet loaded (torch's, cuBLAS's) can wait for the GPU to go idle, which a peer's
# spinning kernel never lets happen; with fewer hardware queues (at most 32) than rank streams,
# two ranks' kernels can be serialised the same way. Either way the call times out.
SHARED_GPU_ENV = {"CUDA_MODULE_LOADING": "EAGER", "CUDA_DEVICE_MAX_CONNECTIONS": "32"}


def set_shared_gpu_env():
    """Sets SHARED_GPU_ENV's variables where the environment leaves them unset: for programs
    (the Python tests, tilewire's benchmarks, the example block) that run virtual ranks sharing
    a GPU. Works only before CUDA starts in this process (before torch touches the GPU)."""
    for name, value in SHARED_GPU_ENV.items():
        os.environ.setdefault(name, value)


def _warn_shared_gpu_env():
    unset = ["%s=%s" % (name, value) for name, value in SHARED_GPU_ENV.items()
             if os.environ.get(name, "").strip().upper() != value]
    if unset:
        warnings.warn(
            "tilewire: virtual ranks share a GPU in this process without %s in the environment "
            "when CUDA started: a rank's kernel can wait behind a peer's, and calls may time out "
            "(TW_ERR_DEVICE_TIMEOUT); set them before importing torch" % " and ".join(unset),
            RuntimeWarning, stacklevel=3)


def init_virtual(world, device=0, sm_budget=0, config=None, *, devices=None):
    """tw_comm_init_all: `world` virtual ranks sharing GPU `device` (or one rank per entry
    of `devices`), each with `sm_budget` SMs (0: the device's SMs / ranks sharing it).
    Returns the list of Comms, rank order.

    Ranks' calls must run concurrently: issue each rank's op on its own stream (each Comm
    has its own ``.stream``; ``tilewire.for_each_rank`` does the fork and join).
    """
    world = int(world)
    if devices is None:
        devices = [_device_index(device)] * max(world, 1)
    else:
        devices = [_device_index(d) for d in devices]
        if len(devices) != world:
            raise ValueError("devices: %d entries for world %d" % (len(devices), world))
    if len(set(devices)) < len(devices):
        _warn_shared_gpu_env()
    cfg = _config(config, sm_budget=sm_budget or None)
    handles = (ctypes.c_void_p * max(world, 1))()
    device_array = (ctypes.c_int * len(devices))(*devices)
    _lib.call("tw_comm_init_all", handles, world, device_array, ctypes.byref(cfg))
    comms = []
    try:
        for r in range(world):
            comms.append(Comm(handles[r], virtual=True))
    except BaseException:
        for c in comms:
            c.close()
        for r in range(len(comms), world):
            _lib.function("tw_comm_destroy")(handles[r])
        raise
    return comms
