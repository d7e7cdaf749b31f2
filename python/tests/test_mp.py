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

import pytest

pytestmark = [pytest.mark.gpu]
needs_mps = pytest.mark.skipif(not os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
                               reason="needs an MPS daemon (CUDA_MPS_PIPE_DIRECTORY unset)")

WORLD = 4
TIMEOUT_S = 300


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
    LOCAL_RANK % (visible GPUs). Returns their outputs once all exited (asserting success)."""
    worker = pathlib.Path(__file__).with_name("_mp_worker.py")
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ)
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env["PYTHONPATH"] = os.pathsep.join(
            [str(root / "python")] + [p for p in [env.get("PYTHONPATH")] if p])
        procs.append(subprocess.Popen([sys.executable, str(worker), mode], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT_S)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("ranks did not finish in %d s" % TIMEOUT_S)
    report = "\n".join("---- rank %d (exit %d)\n%s" % (r, p.returncode, outputs[r])
                       for r, p in enumerate(procs))
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
    """Issue 7's torchrun-style launch: one process per visible GPU, no MPS needed."""
    _launch(root, mode, _gpu_count())
