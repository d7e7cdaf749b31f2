"""Exceptions raised for a tw_status_t other than TW_SUCCESS.

Every failed call raises a subclass of :class:`TilewireError` chosen by the status, carrying
the status (``.status``, ``.status_name``), the C function that failed (``.function``) and
the library's message (``tw_comm_last_error`` of the comm, or ``tw_last_error``), which names
the argument, the rank and what was expected.
"""

import enum


class Status(enum.IntEnum):
    """tw_status_t. ``Status.ERR_CUDA.c_name == "TW_ERR_CUDA"``."""

    SUCCESS = 0
    ERR_INVALID_ARGUMENT = 1
    ERR_NO_DEVICE = 2
    ERR_UNSUPPORTED_DEVICE = 3
    ERR_CUDA = 4
    ERR_OUT_OF_MEMORY = 5
    ERR_SYSTEM = 6
    ERR_TIMEOUT = 7
    ERR_REMOTE = 8
    ERR_DEVICE_TIMEOUT = 9
    ERR_NOT_SUPPORTED = 10
    ERR_INTERNAL = 11
    ERR_ABORTED = 12
    ERR_MISMATCH = 13
    ERR_NETWORK = 14

    @property
    def c_name(self):
        return "TW_" + self.name


class TilewireError(RuntimeError):
    """A tilewire call returned a status other than TW_SUCCESS."""

    def __init__(self, status, message="", function=""):
        self.status = _as_status(status)
        self.message = message
        self.function = function
        super().__init__(self._text())

    @property
    def status_name(self):
        if isinstance(self.status, Status):
            return self.status.c_name
        return "TW_ERR_UNKNOWN(%d)" % int(self.status)

    def _text(self):
        where = self.function + ": " if self.function else ""
        return "%s%s: %s" % (where, self.status_name, self.message or "(no message)")

    def __str__(self):
        return self._text()

    def __reduce__(self):  # picklable across torch.multiprocessing
        return (_rebuild, (int(self.status), self.message, self.function))


class InvalidArgumentError(TilewireError, ValueError):
    """TW_ERR_INVALID_ARGUMENT: the message names the argument."""


class NoDeviceError(TilewireError):
    """TW_ERR_NO_DEVICE: no CUDA driver or no CUDA device."""


class UnsupportedDeviceError(TilewireError):
    """TW_ERR_UNSUPPORTED_DEVICE: the GPU is not sm_90 (Hopper)."""


class CudaError(TilewireError):
    """TW_ERR_CUDA: a CUDA runtime or driver call failed."""


class OutOfMemoryError(TilewireError, MemoryError):
    """TW_ERR_OUT_OF_MEMORY: device memory or symmetric-heap space ran out."""


class SystemCallError(TilewireError):
    """TW_ERR_SYSTEM: a system call or socket operation failed."""


class BootstrapTimeoutError(TilewireError):
    """TW_ERR_TIMEOUT: a host-side wait timed out (a rank never arrived)."""


class RemoteError(TilewireError):
    """TW_ERR_REMOTE: another rank failed and told us so."""


class DeviceTimeoutError(TilewireError):
    """TW_ERR_DEVICE_TIMEOUT: a wait inside a kernel timed out; the comm is unusable."""


class NotSupportedError(TilewireError, NotImplementedError):
    """TW_ERR_NOT_SUPPORTED: a valid request this build or configuration cannot serve."""


class InternalError(TilewireError):
    """TW_ERR_INTERNAL: a bug in tilewire; please report the message."""


class AbortedError(TilewireError):
    """TW_ERR_ABORTED: a kernel gave up because another rank's wait timed out."""


class MismatchError(TilewireError):
    """TW_ERR_MISMATCH: ranks disagree on a collective call (op, shapes, dtypes or plan); the
    message names the op, the ranks and the first differing field. The comm is unusable."""


class NetworkError(TilewireError):
    """TW_ERR_NETWORK: an RDMA transfer to a rank on another node failed, or that rank stopped
    answering; the message names the rank and the NIC. The comm is unusable."""


ERROR_CLASSES = {
    Status.ERR_INVALID_ARGUMENT: InvalidArgumentError,
    Status.ERR_NO_DEVICE: NoDeviceError,
    Status.ERR_UNSUPPORTED_DEVICE: UnsupportedDeviceError,
    Status.ERR_CUDA: CudaError,
    Status.ERR_OUT_OF_MEMORY: OutOfMemoryError,
    Status.ERR_SYSTEM: SystemCallError,
    Status.ERR_TIMEOUT: BootstrapTimeoutError,
    Status.ERR_REMOTE: RemoteError,
    Status.ERR_DEVICE_TIMEOUT: DeviceTimeoutError,
    Status.ERR_NOT_SUPPORTED: NotSupportedError,
    Status.ERR_INTERNAL: InternalError,
    Status.ERR_ABORTED: AbortedError,
    Status.ERR_MISMATCH: MismatchError,
    Status.ERR_NETWORK: NetworkError,
}


def _as_status(code):
    try:
        return Status(int(code))
    except ValueError:
        return int(code)


def error_for(status, message="", function=""):
    """The exception (not raised) for a non-success status."""
    cls = ERROR_CLASSES.get(_as_status(status), TilewireError)
    return cls(status, message, function)


def _rebuild(status, message, function):
    return error_for(status, message, function)
