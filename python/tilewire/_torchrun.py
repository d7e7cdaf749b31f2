"""tilewire.init: joining this process's rank of a multi-process comm under torchrun (or any
launcher that sets RANK / WORLD_SIZE), with rank 0's unique id handed to every rank over
torch.distributed or a TCP store."""

import datetime
import itertools
import os

import torch

from . import _comm

_init_calls = itertools.count()


def _env_int(name, default=None):
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError("environment %s=%r is not an integer" % (name, value)) from None


class _Waiting:
    """Names what a rank was waiting for when the store's bounded wait gives up (a rank that
    failed or never called init), instead of torch's bare store timeout."""

    def __init__(self, what, rank, world, timeout):
        self.what, self.rank, self.world, self.timeout = what, rank, world, timeout

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is not None and issubclass(kind, (RuntimeError, TimeoutError)):
            raise RuntimeError(
                "tilewire.init: rank %d of %d gave up after %s waiting for %s (did a rank fail "
                "before calling tilewire.init, or call it fewer times?): %s"
                % (self.rank, self.world, self.timeout, self.what, exc)) from exc
        return False


def _store_exchange(store, key, uid, rank, world, timeout):
    if rank == 0:
        store.set(key, uid)
        return uid
    with _Waiting("rank 0's unique id (store key %s)" % key, rank, world, timeout):
        store.wait([key], timeout)
    return bytes(store.get(key))


def _share_unique_id(uid, rank, world, group, store, timeout):
    """Hands rank 0's unique id to every rank."""
    import torch.distributed as dist

    key = "tilewire/unique_id/%d" % next(_init_calls)
    if store is not None:
        return _store_exchange(store, key, uid, rank, world, timeout)
    if dist.is_available() and dist.is_initialized():
        objects = [uid if rank == 0 else None]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(objects, src=src, group=group)
        return objects[0]
    addr, port = os.environ.get("MASTER_ADDR"), _env_int("MASTER_PORT")
    if not addr or port is None:
        raise RuntimeError(
            "tilewire.init: rank %d of %d (RANK/WORLD_SIZE) has no way to receive the unique "
            "id: initialise torch.distributed first, set MASTER_ADDR and MASTER_PORT (torchrun "
            "does), or pass store=" % (rank, world)
        )
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent hosts a store at MASTER_ADDR:MASTER_PORT: join it as a client.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        with _Waiting("torchrun's store at %s:%d" % (addr, port), rank, world, timeout):
            base = dist.TCPStore(addr, port, None, False, timeout)
        prefixed = dist.PrefixStore("tilewire/attempt_%s" % attempt, base)
        return _store_exchange(prefixed, key, uid, rank, world, timeout)
    # No store to join: rank 0 hosts one for the exchange and keeps it until every rank has
    # read the id, then closes it so the port is free for a later init_process_group.
    what = ("the other ranks to join its store at %s:%d" % (addr, port) if rank == 0 else
            "rank 0's store at %s:%d" % (addr, port))
    with _Waiting(what, rank, world, timeout):
        tcp = dist.TCPStore(addr, port, world, rank == 0, timeout)
    try:
        uid = _store_exchange(tcp, key, uid, rank, world, timeout)
        if tcp.add(key + "/read", 1) == world:
            tcp.set(key + "/done", b"1")
        if rank == 0:
            with _Waiting("every rank to read the unique id", rank, world, timeout):
                tcp.wait([key + "/done"], timeout)
    finally:
        del tcp
    return uid


def init(*, group=None, store=None, device=None, config=None, sm_budget=None,
         timeout=datetime.timedelta(seconds=300)):
    """Joins this process's rank of a multi-process tilewire comm (tw_comm_init_rank).

    Rank and world come from torch.distributed's `group` (default: the world) when it is
    initialised, else from the environment (RANK, WORLD_SIZE; 0 and 1 when absent). The
    device is `device`, else LOCAL_RANK modulo the visible GPUs, else torch's current
    device; it is made current. Rank 0 makes the unique id and hands it over `store` when
    given, else with torch.distributed.broadcast_object_list over `group`, else through a
    TCP store at MASTER_ADDR:MASTER_PORT (torchrun's own store when it shares it). Every
    rank of the group must call init, the same number of times. With torch.distributed
    initialised the group's name then names the comm for tilewire.fused_all_gather_matmul and
    fused_matmul_reduce_scatter (register_group).
    """
    import torch.distributed as dist

    dist_ready = dist.is_available() and dist.is_initialized()
    if dist_ready:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    else:
        rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    if not 0 <= rank < world:
        raise ValueError("tilewire.init: rank %d is outside [0, world=%d)" % (rank, world))
    if device is None and torch.cuda.is_available():
        local_rank = _env_int("LOCAL_RANK")
        if local_rank is not None:
            device = local_rank % torch.cuda.device_count()
        else:
            device = torch.cuda.current_device()
    if device is not None:
        torch.cuda.set_device(_comm._device_index(device))
    uid = _comm.get_unique_id() if rank == 0 else None
    if world > 1:
        uid = _share_unique_id(uid, rank, world, group, store, timeout)
    comm = _comm.init_rank(world, rank, uid, config, sm_budget=sm_budget)
    if dist_ready:  # the group's name now names this comm for the async-TP ops
        from ._async_tp import register_group

        pg = group if group is not None else dist.group.WORLD
        if isinstance(getattr(pg, "group_name", None), str):
            register_group(pg, comm)
    return comm


def init_mesh(mesh, dims=None, **kwargs):
    """A tilewire comm for each dimension of a torch DeviceMesh (tensor, expert, context
    parallel, ...): {name: tilewire.init(group=mesh.get_group(name), **kwargs)} for the mesh's
    dim names (or `dims`, a subset), made in the mesh's dim order, so that every rank makes
    them in one order. Each group's name then names its comm for the async-TP ops. Every rank
    of the mesh calls it alike. kwargs: tilewire.init's (config, sm_budget, timeout, ...)."""
    names = getattr(mesh, "mesh_dim_names", None)
    if not names:
        raise ValueError("tilewire.init_mesh: the mesh has no dim names; make it with "
                         "init_device_mesh(..., mesh_dim_names=(...))")
    names = tuple(names)
    wanted = names if dims is None else tuple(dims)
    unknown = [d for d in wanted if d not in names]
    if unknown:
        raise ValueError("tilewire.init_mesh: dims %s are not the mesh's (%s)"
                         % (unknown, ", ".join(names)))
    if "group" in kwargs:
        raise TypeError("tilewire.init_mesh: the groups come from the mesh, not group=")
    return {d: init(group=mesh.get_group(d), **kwargs) for d in names if d in wanted}
