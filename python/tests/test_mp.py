"""Processes launched like torchrun (env RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), each running python/tests/_mp_worker.py: tilewire.init, allgather and ag_gemm
against torch references. Four processes on one GPU need a running MPS daemon
(CUDA_MPS_PIPE_DIRECTORY set, as scripts/gpu-suite.sh does); one process per GPU needs two or
more GPUs. Needs torch and Hopper GPUs."""

import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

import pytest

pytestmark = [pytest.mark.gpu]
needs_mps = pytest.mark.skipif(not os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
                               reason="needs an MPS daemon (CUDA_MPS_PIPE_DIRECTORY unset)")

WORLD = 4
# Seconds a launch may take, all ranks together (TW_MP_TIMEOUT_S overrides): under the GPU suite's
# pytest step cap, so a stuck launch fails here with every rank's stages and stacks. Each rank
# dumps its threads' stacks 20 s before.
TIMEOUT_S = float(os.environ.get("TW_MP_TIMEOUT_S", "120"))


def _gpu_count():
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(root, mode, world):
    """Starts `world` workers as torchrun would; tilewire.init puts rank r on GPU
    LOCAL_RANK % (visible GPUs). As torchrun does, the first rank to fail stops the others
    (they would wait for it in init). Asserts that every rank finished and printed its ok."""
    worker = pathlib.Path(__file__).with_name("_mp_worker.py")
    port = _free_port()
    procs, logs = [], []
    for rank in range(world):
        env = dict(os.environ)
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env["TW_MP_STACK_S"] = str(max(TIMEOUT_S - 20, 1))
        # One rank a process needs no extra hardware queues. Under MPS every client keeps the
        # connections it asks for out of one pool of the server's; four clients asking for 32
        # (what the suite sets for virtual ranks) exhaust it on one H200: all but the first
        # fail to create their context with "out of memory".
        env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(root / "python")] + [p for p in [env.get("PYTHONPATH")] if p])
        log = tempfile.TemporaryFile(mode="w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(worker), mode], env=env,
                                      stdout=log, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + TIMEOUT_S
    timed_out = failed = False
    while any(p.poll() is None for p in procs):
        failed = any(p.returncode not in (None, 0) for p in procs)
        timed_out = time.monotonic() > deadline
        if failed or timed_out:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.1)
    for p in procs:
        p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    report = "\n".join("---- rank %d (exit %d)\n%s" % (r, p.returncode, outputs[r])
                       for r, p in enumerate(procs))
    print(report)  # each rank's stages with their seconds (pytest -rP shows them)
    if timed_out:
        pytest.fail("ranks did not finish in %g s; what each printed:\n%s" % (TIMEOUT_S, report))
    assert all(p.returncode == 0 for p in procs), report
    for r in range(world):
        assert "rank %d of %d: ok" % (r, world) in outputs[r], report


@needs_mps
@pytest.mark.parametrize("mode", ["env", "torch.distributed"])
def test_four_processes_on_one_gpu(hopper, root, mode):
    _launch(root, mode, WORLD)


@pytest.mark.skipif(_gpu_count() < 2, reason="needs two or more GPUs")
@pytest.mark.parametrize("mode", ["env", "torch.distributed"])
def test_one_process_per_gpu(hopper, root, mode):
    """The torchrun-style launch: one process per visible GPU, no MPS needed."""
    _launch(root, mode, _gpu_count())
