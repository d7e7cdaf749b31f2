"""The Comm's Python bookkeeping (symmetric allocations, deferred frees, close) and the DLPack
export, on the host: the C calls are replaced by a recorder, and numpy (when installed)
stands in for torch as the DLPack consumer of host memory."""

import ctypes
import gc
import warnings

import pytest

import tilewire
from tilewire import _comm, _dlpack, _lib


class FakeLibrary:
    """Records status-returning calls and fills their out-parameters plausibly."""

    def __init__(self):
        self.calls = []
        self.next_ptr = 0x7F0000000000

    def __call__(self, name, *args, comm=None):
        self.calls.append((name, args))
        if name == "tw_mem_alloc":
            args[2]._obj.value = self.next_ptr
            self.next_ptr += 1 << 21
        elif name in ("tw_comm_rank", "tw_comm_local_rank", "tw_comm_node", "tw_comm_device"):
            args[1]._obj.value = 0
        elif name in ("tw_comm_size", "tw_comm_local_size", "tw_comm_nodes"):
            args[1]._obj.value = 1
        elif name == "tw_comm_sm_budget":
            args[1]._obj.value = 132

    def names(self):
        return [name for name, _ in self.calls]

    def freed(self):
        return [args[1].value for name, args in self.calls if name == "tw_mem_free"]


@pytest.fixture
def fake(monkeypatch):
    lib = FakeLibrary()
    monkeypatch.setattr(_lib, "call", lib)
    monkeypatch.setattr(_comm, "_capturing", lambda: False)
    return lib


def test_comm_reads_its_properties_once(fake):
    comm = tilewire.Comm(0x1234)
    assert (comm.rank, comm.size, comm.world, comm.sm_budget) == (0, 1, 1, 132)
    assert comm.stream is None  # not a virtual rank
    assert _comm.comm_by_id(comm.id) is comm
    comm.close()
    assert comm.closed and "tw_comm_destroy" in fake.names()
    with pytest.raises(ValueError, match="no open tilewire Comm"):
        _comm.comm_by_id(comm.id)
    comm.close()  # idempotent
    assert fake.names().count("tw_comm_destroy") == 1


def test_allocations_are_tracked_and_freed_once(fake):
    comm = tilewire.Comm(0x1234)
    p = comm.alloc(4096)
    q = comm.alloc(64)
    assert comm.find_allocation(p + 100, 200) == (p, 4096)
    assert comm.find_allocation(p + 4000, 200) is None
    assert sorted(comm.live_allocations()) == sorted([(p, 4096), (q, 64)])
    comm.free(q)
    assert fake.freed() == [q]
    with pytest.raises(ValueError, match="not a live allocation"):
        comm.free(q)
    comm._allocs[p].release()
    assert comm._allocs.get(p) is None
    assert fake.freed() == [q, p] and comm.live_allocations() == []
    comm.close()


def test_frees_during_capture_are_deferred(fake, monkeypatch):
    comm = tilewire.Comm(0x1234)
    p = comm.alloc(4096)
    alloc = comm._allocs[p]
    monkeypatch.setattr(_comm, "_capturing", lambda: True)
    alloc.release()
    assert fake.freed() == []
    monkeypatch.setattr(_comm, "_capturing", lambda: False)
    q = comm.alloc(16)  # the next allocation flushes the deferred free first
    assert fake.freed() == [p]
    alloc.release()  # a second release does nothing
    assert fake.freed() == [p]
    comm.free(q)
    comm.close()


def test_close_warns_about_live_allocations_and_ignores_late_releases(fake):
    comm = tilewire.Comm(0x1234)
    alloc = comm._allocs[comm.alloc(4096)]
    with pytest.warns(RuntimeWarning, match="1 symmetric allocation"):
        comm.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        alloc.release()
    assert fake.freed() == []  # tw_comm_destroy freed it


def test_close_at_exit_does_not_warn(fake):
    comm = tilewire.Comm(0x1234)
    comm.alloc(4096)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _comm._close_all()
    assert comm.closed


def test_dlpack_export_frees_when_the_consumer_drops_it(fake):
    np = pytest.importorskip("numpy")
    comm = tilewire.Comm(0x1234)
    p = comm.alloc(48)
    host = (ctypes.c_float * 12)(*range(12))  # host memory standing in for the device's
    before = _dlpack.live_exports()
    capsule, _ = _dlpack.export(ctypes.addressof(host), (3, 4), _dlpack.KDL_FLOAT, 32,
                                _dlpack.KDL_CPU, 0, on_release=comm._allocs[p].release)
    array = np.from_dlpack(_dlpack.Exporter(capsule, _dlpack.KDL_CPU, 0))
    assert array.shape == (3, 4) and array[2, 3] == 11.0
    view = array[1:]
    del array
    gc.collect()
    assert fake.freed() == [] and _dlpack.live_exports() == before + 1
    del view
    gc.collect()
    assert fake.freed() == [p] and _dlpack.live_exports() == before
    comm.close()


def test_dlpack_strides_and_unconsumed_release():
    np = pytest.importorskip("numpy")
    host = (ctypes.c_int32 * 6)(*range(6))
    released = []
    capsule, address = _dlpack.export(ctypes.addressof(host), (2, 3), _dlpack.KDL_INT, 32,
                                      _dlpack.KDL_CPU, 0, on_release=lambda: released.append(1),
                                      strides=(1, 2))
    array = np.from_dlpack(_dlpack.Exporter(capsule, _dlpack.KDL_CPU, 0))
    assert array.tolist() == [[0, 2, 4], [1, 3, 5]]
    del array
    gc.collect()
    assert released == [1]
    _dlpack.release(address)  # idempotent
    assert released == [1]
    _, address = _dlpack.export(0, (1,), _dlpack.KDL_UINT, 8, _dlpack.KDL_CPU, 0,
                                on_release=lambda: released.append(2))
    _dlpack.release(address)  # a capsule nobody consumed
    assert released == [1, 2]
