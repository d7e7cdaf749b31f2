"""Bad arguments to the ops of the torch front end (gemm, allgather, ag_gemm, gemm_rs, gemm_ar) on
a Hopper GPU: outputs aliasing inputs, outputs too small, buffers outside the symmetric heap
where the op needs it, host tensors, shapes off the contract. Skipped without torch or without a
Hopper GPU.

Where the front end's own checks refuse (shapes, devices, symmetric tensors, M a multiple of
world), the error is the ValueError they document, naming the op and the argument, and the call
never reaches the library. Where they let the call through (aliasing is the library's check
alone), or where it is made below them (torch.ops.tilewire.*, whose implementations skip the
public checks, or an args struct passed through tilewire._lib), the library refuses it: the
error is InvalidArgumentError (a TilewireError and a ValueError) from the C function, carrying
the library's message, which names the argument as the C API does (args->out, recv, ...).

Every refusal happens before anything is launched, on every rank alike, so it leaves the comm
as it was: after each one, a valid call of the same op on the same comms matches torch."""

import ctypes

import pytest

torch = pytest.importorskip("torch")

import tilewire  # noqa: E402
import tilewire._torch  # noqa: E402 - registers the custom ops, torch.ops.tilewire.*
from tilewire import _eager, _glue, _lib  # noqa: E402
from _gpu import TOL, ag_inputs, bf16, close_all, gemm_inputs, ref_product, rel_err  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("hopper_synced")]

# torch.ops.tilewire.* exist on a torch with torch.library.custom_op; without it the cases that
# go through them are left out.
CUSTOM_OPS = _glue._HAVE_CUSTOM_OP


def _by_library(call, function, *needles):
    """call() is refused by the C function `function`: InvalidArgumentError whose message (the
    library's, as tw_comm_last_error / tw_last_error gave it) holds every needle."""
    with pytest.raises(tilewire.InvalidArgumentError) as info:
        call()
    err = info.value
    assert isinstance(err, tilewire.TilewireError) and isinstance(err, ValueError)
    assert err.status == tilewire.Status.ERR_INVALID_ARGUMENT, str(err)
    assert err.function == function, str(err)
    assert str(err) == "%s: TW_ERR_INVALID_ARGUMENT: %s" % (function, err.message)
    for needle in needles:
        assert needle in err.message, "%r not in %r" % (needle, err.message)


def _by_front_end(call, cls, *needles):
    """call() is refused by the front end's own checks: `cls` (TypeError / ValueError), not a
    TilewireError (the library was not called), with every needle in its message."""
    with pytest.raises(cls) as info:
        call()
    err = info.value
    assert not isinstance(err, tilewire.TilewireError), "reached the library: %s" % err
    for needle in needles:
        assert needle in str(err), "%r not in %r" % (needle, str(err))


def _stream():
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def _p(t_or_ptr):
    """A pointer as the library's messages print it (%p)."""
    ptr = t_or_ptr.data_ptr() if isinstance(t_or_ptr, torch.Tensor) else t_or_ptr
    return "%#x" % ptr


def _address_range(ptr):
    """(base, bytes) of the driver allocation holding ptr, as tw_check_device_range reads it
    (cuMemGetAddressRange), or None where the driver reports none."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    fn = cuda.cuMemGetAddressRange_v2
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                   ctypes.c_uint64]
    fn.restype = ctypes.c_int
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    if fn(ctypes.byref(base), ctypes.byref(size), ptr) != 0:
        return None
    return base.value, size.value


def _run_cases(comms, cases, still_works):
    """Each case on every rank of comms (None: once, for an op without a comm), each rank's
    call refused, then a valid call of the op. A case is (name, check(comm), None or a
    collective step run before it)."""
    for name, check, before in cases:
        if before is not None:
            before()
        for c in comms or [None]:
            try:
                check(c)
            except BaseException as e:
                if hasattr(e, "add_note"):  # Python 3.11+
                    e.add_note("case %r%s" % (name, "" if c is None else ", rank %d" % c.rank))
                raise
        try:
            still_works()
        except BaseException as e:
            if hasattr(e, "add_note"):
                e.add_note("the valid call after case %r" % name)
            raise
    for c in comms or []:
        assert c.async_error() is None


def _lane_holds(op, comm=None):
    """The fast lane holds a call of `op` (on `comm`); True where the lane is off."""
    if not _eager._LANE_ON:
        return True
    return any(key[0] == op and (comm is None or key[1] == comm.id) for key in _eager._lane)


# ---- gemm ---------------------------------------------------------------------------------


def test_gemm_refusals():
    m, n, k = 128, 256, 256  # n == k: a [m, k] and b's rows can stand for out [m, n]
    a, b = gemm_inputs(m, n, k, seed=21)
    a_was, b_was = a.clone(), b.clone()
    ref = ref_product(a, b)
    host = torch.empty(m, n, dtype=bf16)

    def still_works():
        assert torch.equal(a, a_was) and torch.equal(b, b_was), "a refused call wrote"
        assert rel_err(tilewire.gemm(a, b), ref) < TOL[bf16]

    def raw(**fields):
        args = tilewire.GemmArgs(m=m, n=n, k=k, a=a.data_ptr(), b=b.data_ptr(), **fields)
        return lambda: _lib.call("tw_gemm", ctypes.byref(args), _stream())

    def out_is_a(_):
        _by_library(lambda: tilewire.gemm(a, b, out=a), "tw_gemm",
                    "tw_gemm: c (%s, %d bytes) overlaps a (%s, %d bytes)"
                    % (_p(a), m * n * 2, _p(a), m * k * 2))

    def out_overlaps_b(_):
        out = b[64:64 + m]
        _by_library(lambda: tilewire.gemm(a, b, out=out), "tw_gemm",
                    "tw_gemm: c (%s, %d bytes) overlaps b (%s, %d bytes)"
                    % (_p(out), m * n * 2, _p(b), n * k * 2))

    lane_out = torch.empty_like(a)  # the signature of gemm(a, b, out=a)

    def lane_step():
        assert rel_err(tilewire.gemm(a, b, out=lane_out), ref) < TOL[bf16]
        assert _lane_holds("gemm")

    def out_is_a_by_the_lane(_):
        out_is_a(_)  # the lane sets the pointers and calls tw_gemm, which refuses as before

    def out_too_small_front_end(_):
        small = torch.empty(m - 8, n, device="cuda", dtype=bf16)
        _by_front_end(lambda: tilewire.gemm(a, b, out=small), ValueError,
                      "tilewire.gemm: out must be [M=%d, N=%d], got shape (%d, %d)"
                      % (m, n, m - 8, n))

    def host_front_end(_):
        _by_front_end(lambda: tilewire.gemm(a.cpu(), b), ValueError,
                      "tilewire.gemm: a is on cpu; tilewire needs CUDA tensors")
        _by_front_end(lambda: tilewire.gemm(a, b, out=host), ValueError,
                      "tilewire.gemm: out is on cpu; tilewire needs CUDA tensors")

    def host_library(_):
        _by_library(raw(c=host.data_ptr()), "tw_gemm",
                    "tw_gemm: c: %s is not device memory" % _p(host))
        pinned = host.pin_memory()
        _by_library(raw(c=pinned.data_ptr()), "tw_gemm",
                    "tw_gemm: c: %s is pinned host memory; the op needs device memory"
                    % _p(pinned))
        a_host = a.cpu()
        _by_library(lambda: _lib.call("tw_gemm", ctypes.byref(tilewire.GemmArgs(
            m=m, n=n, k=k, a=a_host.data_ptr(), b=b.data_ptr(), c=lane_out.data_ptr())),
            _stream()), "tw_gemm", "tw_gemm: a: %s is not device memory" % _p(a_host))

    _run_cases(None, [
        ("out is a", out_is_a, None),
        ("out is a view overlapping b", out_overlaps_b, None),
        ("out is a, by the fast lane", out_is_a_by_the_lane, lane_step),
        ("out too small: the front end", out_too_small_front_end, None),
        ("a host tensor: the front end", host_front_end, None),
        ("host memory: the library", host_library, None),
    ], still_works)


def test_gemm_out_past_its_allocation():
    """An out too small for m x n, which the front end refuses by its shape, made below it: c
    in the last 256 bytes of a's driver allocation, whose extent tw_gemm reads."""
    m, n, k = 128, 256, 256
    a, b = gemm_inputs(m, n, k, seed=22)
    extent = _address_range(a.data_ptr())
    if extent is None:
        pytest.skip("the driver reports no extent for torch's allocation")
    base, size = extent
    c = base + size - 256
    args = tilewire.GemmArgs(m=m, n=n, k=k, a=a.data_ptr(), b=b.data_ptr(), c=c)
    _by_library(lambda: _lib.call("tw_gemm", ctypes.byref(args), _stream()), "tw_gemm",
                "tw_gemm: c: the call's %d bytes from %s run past the end of its allocation "
                "(256 bytes left)" % (m * n * 2, _p(c)))
    assert rel_err(tilewire.gemm(a, b), ref_product(a, b)) < TOL[bf16]


# ---- allgather ----------------------------------------------------------------------------


def test_allgather_refusals():
    world, count = 2, 1024  # bf16 elements per rank
    nbytes = count * 2
    comms = tilewire.init_virtual(world)
    try:
        xs = [torch.randn(count, device="cuda", dtype=bf16) for _ in comms]
        outs = tilewire.symmetric_empty(comms, (world * count,), bf16)
        small = tilewire.symmetric_empty(comms, (world * count - 8,), bf16)
        plain = torch.empty(world * count, device="cuda", dtype=bf16)
        host = torch.empty(count, dtype=bf16)

        def still_works():
            tilewire.for_each_rank(
                comms, lambda c: tilewire.allgather(c, xs[c.rank], outs[c.rank]))
            torch.cuda.synchronize()
            for r in range(world):
                assert torch.equal(outs[r], torch.cat(xs)), "rank %d" % r

        def raw(c, send, recv, size=nbytes):
            return lambda: _lib.call("tw_allgather", c.handle, ctypes.c_void_p(send),
                                     ctypes.c_void_p(recv), ctypes.c_size_t(size), _stream())

        def own_slot(c):
            return outs[c.rank].data_ptr() + c.rank * nbytes

        def x_in_another_slot(c):
            other = (c.rank + 1) % world
            x = outs[c.rank][other * count:(other + 1) * count]
            _by_library(lambda: tilewire.allgather(c, x, outs[c.rank]), "tw_allgather",
                        "send: %s overlaps recv but is not recv + rank * bytes (%s)"
                        % (_p(x), _p(own_slot(c))))

        def x_overlaps_out(c):
            x = outs[c.rank][8:8 + count]  # 16 bytes into rank 0's slot
            _by_library(lambda: tilewire.allgather(c, x, outs[c.rank]), "tw_allgather",
                        "send: %s overlaps recv but is not recv + rank * bytes (%s)"
                        % (_p(x), _p(own_slot(c))))

        def out_too_small_front_end(c):
            _by_front_end(lambda: tilewire.allgather(c, xs[c.rank], small[c.rank]), ValueError,
                          "tilewire.allgather: out has %d elements; it must have world * "
                          "x.numel()" % (world * count - 8))

        def out_too_small_library(c):
            _by_library(lambda: torch.ops.tilewire.allgather(c.id, xs[c.rank], small[c.rank]),
                        "tw_allgather",
                        "recv: %d bytes at offset 0 run past the end of its %d-byte symmetric "
                        "allocation" % (world * nbytes, (world * count - 8) * 2))

        def out_not_symmetric_front_end(c):
            _by_front_end(lambda: tilewire.allgather(c, xs[c.rank], plain), ValueError,
                          "tilewire.allgather: out must be a symmetric tensor of rank %d's comm"
                          % c.rank)

        def out_not_symmetric_library(c):
            _by_library(raw(c, xs[c.rank].data_ptr(), plain.data_ptr()), "tw_allgather",
                        "recv: %s (+%d bytes) is not inside a tw_mem_alloc allocation of rank %d"
                        % (_p(plain), world * nbytes, c.rank))
            # another rank's symmetric tensor is not this rank's allocation either
            theirs = outs[(c.rank + 1) % world]
            _by_library(raw(c, xs[c.rank].data_ptr(), theirs.data_ptr()), "tw_allgather",
                        "recv: %s (+%d bytes) is not inside a tw_mem_alloc allocation of rank %d"
                        % (_p(theirs), world * nbytes, c.rank))

        def host_front_end(c):
            _by_front_end(lambda: tilewire.allgather(c, host, outs[c.rank]), ValueError,
                          "tilewire.allgather: x is on cpu; tilewire needs CUDA tensors")

        def host_library(c):
            _by_library(raw(c, host.data_ptr(), outs[c.rank].data_ptr()), "tw_allgather",
                        "send: %s is not device memory" % _p(host))

        def bytes_front_end(c):
            empty = xs[c.rank][:0]
            _by_front_end(lambda: tilewire.allgather(c, empty, outs[c.rank]), ValueError,
                          "tilewire.allgather: x has 0 bytes; it must be a positive multiple "
                          "of 16")

        def bytes_library(c):
            send, recv = xs[c.rank].data_ptr(), outs[c.rank].data_ptr()
            _by_library(raw(c, send, recv, 0), "tw_allgather", "bytes: 0")
            _by_library(raw(c, send, recv, 8), "tw_allgather", "bytes: 8 is not a multiple of 16")

        cases = [
            ("x is another rank's slot of out", x_in_another_slot, None),
            ("x overlaps out off its slot", x_overlaps_out, None),
            ("out too small: the front end", out_too_small_front_end, None),
            ("out not symmetric: the front end", out_not_symmetric_front_end, None),
            ("out not symmetric: the library", out_not_symmetric_library, None),
            ("x on the host: the front end", host_front_end, None),
            ("send in host memory: the library", host_library, None),
            ("zero bytes: the front end", bytes_front_end, None),
            ("zero or unaligned bytes: the library", bytes_library, None),
        ]
        if CUSTOM_OPS:
            cases.append(("out too small: the library", out_too_small_library, None))
        _run_cases(comms, cases, still_works)
        outs.clear()
        small.clear()
    finally:
        close_all(comms)


# ---- ag_gemm ------------------------------------------------------------------------------


def test_ag_gemm_refusals():
    world, m_local, n, k = 2, 128, 256, 256  # n == k: a_gathered can stand for out
    rows = world * m_local
    shard = m_local * k * 2
    comms = tilewire.init_virtual(world)
    try:
        gathered, a, b = ag_inputs(comms, m_local, n, k)
        small_gathered = tilewire.symmetric_empty(comms, (rows - 8, k), bf16)
        small_out = tilewire.symmetric_empty(comms, (rows - 8, n), bf16)
        outs = [torch.empty(rows, n, device="cuda", dtype=bf16) for _ in comms]
        plain_gathered = torch.empty(rows, k, device="cuda", dtype=bf16)
        host_b = b.cpu()
        ref = ref_product(torch.cat(a), b)

        def still_works():
            got = tilewire.for_each_rank(
                comms, lambda c: tilewire.ag_gemm(c, a[c.rank], b, gathered[c.rank]))
            torch.cuda.synchronize()
            for r in range(world):
                assert torch.equal(gathered[r], torch.cat(a)), "rank %d's a_gathered" % r
                assert rel_err(got[r], ref) < TOL[bf16], "rank %d" % r

        def raw(c, **fields):
            r = c.rank
            values = dict(a=a[r].data_ptr(), b=b.data_ptr(), c=outs[r].data_ptr(),
                          a_gathered=gathered[r].data_ptr(), m_local=m_local, n=n, k=k)
            values.update(fields)
            args = tilewire.AgGemmArgs(**values)
            return lambda: _lib.call("tw_ag_gemm", c.handle, ctypes.byref(args), _stream())

        def out_holds_a(c):
            out = torch.empty(rows, n, device="cuda", dtype=bf16)
            x = out[:m_local]
            x.copy_(a[c.rank])
            _by_library(lambda: tilewire.ag_gemm(c, x, b, gathered[c.rank], out=out),
                        "tw_ag_gemm",
                        "args->c (%s, %d bytes) overlaps args->a (%s, %d bytes)"
                        % (_p(out), rows * n * 2, _p(x), shard))

        def a_in_another_slot(c):
            g = gathered[c.rank]
            other = (c.rank + 1) % world
            x = g[other * m_local:(other + 1) * m_local]
            _by_library(lambda: tilewire.ag_gemm(c, x, b, g), "tw_ag_gemm",
                        "args->a: %s overlaps a_gathered but is not a_gathered + rank * m_local "
                        "* k (%s)" % (_p(x), _p(g.data_ptr() + c.rank * shard)))

        def out_is_a_gathered(c):
            g = gathered[c.rank]
            _by_library(lambda: tilewire.ag_gemm(c, a[c.rank], b, g, out=g), "tw_ag_gemm",
                        "args->c (%s, %d bytes) overlaps args->a_gathered (%s, %d bytes)"
                        % (_p(g), rows * n * 2, _p(g), rows * k * 2))

        def gathered_too_small_front_end(c):
            _by_front_end(
                lambda: tilewire.ag_gemm(c, a[c.rank], b, small_gathered[c.rank]), ValueError,
                "tilewire.ag_gemm: a_gathered must be a contiguous symmetric tensor (comm.empty) "
                "of at least world * m_local * K = %d * %d * %d elements" % (world, m_local, k))

        def gathered_too_small_library(c):
            r = c.rank
            _by_library(lambda: torch.ops.tilewire.ag_gemm(c.id, a[r], b, small_gathered[r],
                                                           outs[r], 0, 0), "tw_ag_gemm",
                        "args->a_gathered: %d bytes at offset 0 run past the end of its "
                        "%d-byte symmetric allocation" % (rows * k * 2, (rows - 8) * k * 2))

        def out_too_small_front_end(c):
            out = torch.empty(rows - 8, n, device="cuda", dtype=bf16)
            _by_front_end(lambda: tilewire.ag_gemm(c, a[c.rank], b, gathered[c.rank], out=out),
                          ValueError, "tilewire.ag_gemm: out must be [world * m_local=%d, N=%d]"
                          % (rows, n))

        def out_too_small_library(c):
            r = c.rank
            _by_library(lambda: torch.ops.tilewire.ag_gemm(c.id, a[r], b, gathered[r],
                                                           small_out[r], 0, 0), "tw_ag_gemm",
                        "args->c: %d bytes at offset 0 run past the end of its %d-byte "
                        "symmetric allocation" % (rows * n * 2, (rows - 8) * n * 2))

        def gathered_not_symmetric_front_end(c):
            _by_front_end(lambda: tilewire.ag_gemm(c, a[c.rank], b, plain_gathered), ValueError,
                          "tilewire.ag_gemm: a_gathered must be a symmetric tensor of rank %d's "
                          "comm" % c.rank)

        def gathered_not_symmetric_library(c):
            _by_library(raw(c, a_gathered=plain_gathered.data_ptr()), "tw_ag_gemm",
                        "args->a_gathered: %s (+%d bytes) is not inside a tw_mem_alloc "
                        "allocation of rank %d" % (_p(plain_gathered), rows * k * 2, c.rank))

        def host_front_end(c):
            _by_front_end(lambda: tilewire.ag_gemm(c, a[c.rank], host_b, gathered[c.rank]),
                          ValueError, "tilewire.ag_gemm: b is on cpu; tilewire needs CUDA tensors")

        def host_library(c):
            _by_library(raw(c, b=host_b.data_ptr()), "tw_ag_gemm",
                        "args->b: %s is not device memory" % _p(host_b))

        def dims_front_end(c):
            _by_front_end(lambda: tilewire.ag_gemm(c, a[c.rank][:0], b, gathered[c.rank]),
                          ValueError, "tilewire.ag_gemm: a must have at least one row")

        def dims_library(c):
            _by_library(raw(c, m_local=0), "tw_ag_gemm",
                        "args->m_local: 0; expected 1 <= m_local")
            _by_library(raw(c, m_local=-4), "tw_ag_gemm",
                        "args->m_local: -4; expected 1 <= m_local")
            _by_library(raw(c, n=-8), "tw_ag_gemm",
                        "args->n: -8; expected a positive multiple of 8")
            _by_library(raw(c, k=0), "tw_ag_gemm", "args->k: 0; expected a positive multiple of 8")

        cases = [
            ("out holds a", out_holds_a, None),
            ("a is another rank's slot of a_gathered", a_in_another_slot, None),
            ("out is a_gathered", out_is_a_gathered, None),
            ("a_gathered too small: the front end", gathered_too_small_front_end, None),
            ("out too small: the front end", out_too_small_front_end, None),
            ("a_gathered not symmetric: the front end", gathered_not_symmetric_front_end, None),
            ("a_gathered not symmetric: the library", gathered_not_symmetric_library, None),
            ("b on the host: the front end", host_front_end, None),
            ("b in host memory: the library", host_library, None),
            ("no rows: the front end", dims_front_end, None),
            ("zero and negative dims: the library", dims_library, None),
        ]
        if CUSTOM_OPS:
            cases += [("a_gathered too small: the library", gathered_too_small_library, None),
                      ("out too small: the library", out_too_small_library, None)]
        _run_cases(comms, cases, still_works)
        for bufs in (gathered, small_gathered, small_out):
            bufs.clear()
    finally:
        close_all(comms)


# ---- gemm_rs / gemm_ar --------------------------------------------------------------------


_OWN = object()  # _ReduceCases.call: the rank's own workspace


class _ReduceCases:
    """The cases of gemm_rs (scatter) or gemm_ar on `comms`, with the tensors they use: all
    symmetric ones made here, up front and in the same order on every rank."""

    m, n, k = 256, 256, 256  # n == k: a's rows, and b's, can stand for out's

    def __init__(self, op, comms):
        m, n, k = self.m, self.n, self.k
        self.op, self.comms, self.world = op, comms, len(comms)
        self.scatter = op == "gemm_rs"
        self.function = "tw_" + op
        self.public = getattr(tilewire, op)
        self.rows = m // self.world if self.scatter else m
        self.out_bytes = self.rows * n * 2
        self.a = [torch.randn(m, k, device="cuda", dtype=bf16) for _ in comms]
        self.b = [torch.randn(n, k, device="cuda", dtype=bf16) for _ in comms]
        self.a_was = [t.clone() for t in self.a]
        self.ref = sum(ref_product(self.a[r], self.b[r]) for r in range(self.world))
        self.ws = [tilewire.gemm_rs_workspace(c, m, n) if self.world > 1 else None
                   for c in comms]
        need = comms[0].gemm_rs_workspace_size(m, n)
        self.big_ws = tilewire.symmetric_empty(comms, (max(need, m * k * 2),), torch.uint8)
        self.tiny_ws = tilewire.symmetric_empty(comms, (256,), torch.uint8)
        self.small_out = tilewire.symmetric_empty(comms, (self.rows - 8, n), bf16)
        self.outs = [torch.empty(self.rows, n, device="cuda", dtype=bf16) for _ in comms]
        self.lane_outs = [torch.empty(self.rows, n, device="cuda", dtype=bf16) for _ in comms]
        self.plain_ws = torch.empty(max(need, 1 << 20), device="cuda", dtype=torch.uint8)
        self.host = torch.empty(self.rows, n, dtype=bf16)

    def drop_symmetric(self):
        for bufs in (self.ws, self.big_ws, self.tiny_ws, self.small_out):
            bufs.clear()

    def still_works(self):
        a, b, ws, rows = self.a, self.b, self.ws, self.rows
        got = tilewire.for_each_rank(
            self.comms, lambda c: self.public(c, a[c.rank], b[c.rank], ws[c.rank]))
        torch.cuda.synchronize()
        for r in range(self.world):
            assert torch.equal(a[r], self.a_was[r]), "a refused call wrote rank %d's a" % r
            want = self.ref[r * rows:(r + 1) * rows] if self.scatter else self.ref
            assert rel_err(got[r], want) < TOL[bf16], "rank %d" % r

    def raw(self, c, **fields):
        """The call of the C function with an args struct: the valid one, but for `fields`."""
        r = c.rank
        ws = self.ws[r]
        values = dict(a=self.a[r].data_ptr(), b=self.b[r].data_ptr(),
                      out=self.outs[r].data_ptr(), workspace=None if ws is None else ws.data_ptr(),
                      m=self.m, n=self.n, k=self.k)
        values.update(fields)
        args = tilewire.GemmRsArgs(**values)
        return lambda: _lib.call(self.function, c.handle, ctypes.byref(args), _stream())

    def custom_op(self, c, a, out, out_symmetric=0):
        """The call of torch.ops.tilewire.<op>, below the public checks."""
        r = c.rank
        ws = self.ws[r] if self.ws[r] is not None else torch.empty(0, device="cuda",
                                                                   dtype=torch.uint8)
        if self.scatter:
            return lambda: torch.ops.tilewire.gemm_rs(c.id, a, self.b[r], ws, out, 0, 0)
        return lambda: torch.ops.tilewire.gemm_ar(c.id, a, self.b[r], ws, out, 0, 0,
                                                  out_symmetric)

    def call(self, c, a=None, ws=_OWN, **kw):
        """The public call on rank c: its own a, b and workspace unless given."""
        r = c.rank
        a = self.a[r] if a is None else a
        ws = self.ws[r] if ws is _OWN else ws
        return lambda: self.public(c, a, self.b[r], ws, **kw)

    # ---- the cases: each refuses rank c's call -------------------------------------------

    def out_is_a(self, c):
        a = self.a[c.rank]
        out = a if self.rows == self.m else a[:self.rows]  # the tensor, or a view of its rows
        _by_library(self.call(c, out=out), self.function,
                    "%s: args->out (%s, %d bytes) overlaps a (%s, %d bytes)"
                    % (self.function, _p(out), self.out_bytes, _p(a), self.m * self.k * 2))

    def out_is_b(self, c):
        b = self.b[c.rank]
        out = b[:self.rows]
        _by_library(self.call(c, out=out), self.function,
                    "%s: args->out (%s, %d bytes) overlaps b (%s, %d bytes)"
                    % (self.function, _p(out), self.out_bytes, _p(b), self.n * self.k * 2))

    def lane_step(self):
        """A valid call with the signature of out_is_b's, which the fast lane then keeps."""
        tilewire.for_each_rank(self.comms, lambda c: self.call(c, out=self.lane_outs[c.rank])())
        torch.cuda.synchronize()
        for c in self.comms:
            assert _lane_holds("tilewire." + self.op, c)

    def workspace_holds_a(self, c):
        ws = self.big_ws[c.rank]
        x = ws[:self.m * self.k * 2].view(bf16).view(self.m, self.k)
        _by_library(self.call(c, a=x, ws=ws), self.function,
                    "%s: args->workspace (%s, " % (self.function, _p(ws)),
                    "bytes) overlaps a (%s, %d bytes)" % (_p(x), self.m * self.k * 2))

    def out_too_small_front_end(self, c):
        out = torch.empty(self.rows - 8, self.n, device="cuda", dtype=bf16)
        _by_front_end(self.call(c, out=out), ValueError,
                      "tilewire.%s: out must be [%s=%d, N=%d], got shape (%d, %d)"
                      % (self.op, "M / world" if self.scatter else "M", self.rows, self.n,
                         self.rows - 8, self.n))

    def out_too_small_library(self, c):
        _by_library(self.custom_op(c, self.a[c.rank], self.small_out[c.rank]), self.function,
                    "%s: args->out: %d bytes at offset 0 run past the end of its %d-byte "
                    "symmetric allocation"
                    % (self.function, self.out_bytes, (self.rows - 8) * self.n * 2))

    def workspace_front_end(self, c):
        _by_front_end(self.call(c, ws=None), ValueError,
                      "tilewire.%s: workspace is needed when world > 1" % self.op)
        _by_front_end(self.call(c, ws=self.plain_ws), ValueError,
                      "tilewire.%s: workspace must be a symmetric tensor of rank %d's comm"
                      % (self.op, c.rank), "not symmetric")

    def workspace_library(self, c):
        _by_library(self.raw(c, workspace=None), self.function,
                    "%s: args->workspace: NULL; allocate tw_gemm_rs_workspace_size() bytes "
                    "with tw_mem_alloc" % self.function)
        _by_library(self.raw(c, workspace=self.plain_ws.data_ptr()), self.function,
                    "args->workspace: %s (+" % _p(self.plain_ws),
                    "bytes) is not inside a tw_mem_alloc allocation of rank %d" % c.rank)
        _by_library(self.raw(c, workspace=self.tiny_ws[c.rank].data_ptr()), self.function,
                    "args->workspace: ", "run past the end of its 256-byte symmetric allocation")

    def out_symmetric_front_end(self, c):
        _by_front_end(self.call(c, out=self.outs[c.rank], out_symmetric=True), ValueError,
                      "tilewire.gemm_ar: out_symmetric=True needs out, a contiguous symmetric "
                      "tensor of rank %d's comm" % c.rank)

    def out_symmetric_library(self, c):
        out = self.outs[c.rank]
        _by_library(self.custom_op(c, self.a[c.rank], out, out_symmetric=1), self.function,
                    "args->out (out_symmetric): %s (+%d bytes) is not inside a tw_mem_alloc "
                    "allocation of rank %d" % (_p(out), self.out_bytes, c.rank))

    def host_front_end(self, c):
        _by_front_end(self.call(c, a=self.a[c.rank].cpu()), ValueError,
                      "tilewire.%s: a is on cpu; tilewire needs CUDA tensors" % self.op)

    def host_library(self, c):
        _by_library(self.raw(c, out=self.host.data_ptr()), self.function,
                    "%s: args->out: %s is not device memory" % (self.function, _p(self.host)))

    def m_not_multiple_front_end(self, c):
        _by_front_end(self.call(c, a=self.a[c.rank][:self.m - 1]), ValueError,
                      "tilewire.%s: M=%d (a.shape[0]) must be a positive multiple of world=%d"
                      % (self.op, self.m - 1, self.world))

    def m_not_multiple_library(self, c):
        _by_library(self.raw(c, m=self.m - 1), self.function,
                    "%s: args->m: %d is not divisible by the world size %d"
                    % (self.function, self.m - 1, self.world))

    def m_not_multiple_custom_op(self, c):
        # the implementation sizes the workspace first: tw_gemm_rs_workspace_size refuses
        _by_library(self.custom_op(c, self.a[c.rank][:self.m - 1], self.outs[c.rank]),
                    "tw_gemm_rs_workspace_size",
                    "m: %d; expected a positive multiple of the world size %d"
                    % (self.m - 1, self.world))

    def dims_front_end(self, c):
        _by_front_end(self.call(c, a=self.a[c.rank][:0]), ValueError,
                      "tilewire.%s: M=0 (a.shape[0]) must be a positive multiple of world=%d"
                      % (self.op, self.world))

    def dims_library(self, c):
        f = self.function
        _by_library(self.raw(c, m=0), f, "%s: args->m: 0; expected 1 <= m < 2^31" % f)
        _by_library(self.raw(c, m=-self.world), f,
                    "%s: args->m: %d; expected 1 <= m < 2^31" % (f, -self.world))
        _by_library(self.raw(c, n=-8), f, "%s: args->n: -8; expected a positive multiple of 8" % f)
        _by_library(self.raw(c, k=0), f, "%s: args->k: 0; expected a positive multiple of 8" % f)

    def cases(self):
        cases = [
            ("out is a" if self.rows == self.m else "out is a view of a's rows", self.out_is_a,
             None),
            ("out is a view of b's rows", self.out_is_b, None),
            ("out is b's rows, by the fast lane", self.out_is_b, self.lane_step),
            ("out too small: the front end", self.out_too_small_front_end, None),
            ("a on the host: the front end", self.host_front_end, None),
            ("out in host memory: the library", self.host_library, None),
            ("no rows: the front end", self.dims_front_end, None),
            ("zero and negative dims: the library", self.dims_library, None),
        ]
        if CUSTOM_OPS:
            cases.append(("out too small: the library", self.out_too_small_library, None))
        if self.world > 1:
            cases += [
                ("the workspace holds a", self.workspace_holds_a, None),
                ("workspace missing or not symmetric: the front end", self.workspace_front_end,
                 None),
                ("workspace missing, not symmetric or too small: the library",
                 self.workspace_library, None),
                ("M not a multiple of world: the front end", self.m_not_multiple_front_end,
                 None),
                ("M not a multiple of world: the library", self.m_not_multiple_library, None),
            ]
            if CUSTOM_OPS:
                cases.append(("M not a multiple of world: torch.ops",
                              self.m_not_multiple_custom_op, None))
        if not self.scatter:
            cases.append(("out_symmetric, a plain out: the front end",
                          self.out_symmetric_front_end, None))
            if self.world > 1 and CUSTOM_OPS:
                cases.append(("out_symmetric, a plain out: the library",
                              self.out_symmetric_library, None))
        return cases


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("op", ["gemm_rs", "gemm_ar"])
def test_gemm_reduce_refusals(op, world):
    comms = tilewire.init_virtual(world)
    try:
        cases = _ReduceCases(op, comms)
        _run_cases(comms, cases.cases(), cases.still_works)
        cases.drop_symmetric()
    finally:
        close_all(comms)


def test_ranks_that_disagree_raise_mismatch_error():
    """Two virtual ranks whose gemm_rs calls differ in N (each valid on its own): the kernels end
    without writing into a peer and each comm's async_error() is a MismatchError carrying the
    library's message, which names the op and both values; the next call on the comm raises it
    at once, on the host."""
    world, m, k = 2, 256, 256
    comms = tilewire.init_virtual(world)
    try:
        ws = [tilewire.gemm_rs_workspace(c, m, 256) for c in comms]
        a = [torch.randn(m, k, device="cuda", dtype=bf16) for _ in range(world)]
        b = [torch.randn(256 if r == 0 else 128, k, device="cuda", dtype=bf16)
             for r in range(world)]
        tilewire.for_each_rank(comms, lambda c: tilewire.gemm_rs(c, a[c.rank], b[c.rank],
                                                                 ws[c.rank]))
        torch.cuda.synchronize()
        for c in comms:
            err = c.async_error()
            assert isinstance(err, tilewire.MismatchError), err
            assert isinstance(err, tilewire.TilewireError)
            assert "tw_gemm_rs" in str(err) and "n = 256" in str(err) and "n = 128" in str(err)
        with pytest.raises(tilewire.MismatchError) as info:
            tilewire.gemm_rs(comms[0], a[0], b[0], ws[0])
        assert "unusable since an earlier call failed" in str(info.value)
        del info  # its traceback holds the workspace, which must go before the comms close
        ws.clear()
    finally:
        close_all(comms)
