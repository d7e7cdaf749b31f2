"""Four processes on one GPU under MPS, launched like torchrun (env RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), each running python/tests/_mp_worker.py: tilewire.init,
allgather and ag_gemm against torch references. Needs torch, a Hopper GPU and a running MPS
daemon (CUDA_MPS_PIPE_DIRECTORY set, as scripts/gpu-suite.sh does)."""

import os
import pathlib
import socket
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
                       reason="needs an MPS daemon (CUDA_MPS_PIPE_DIRECTORY unset)"),
]

WORLD = 4
TIMEOUT_S = 300


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", ["env", "torch.distributed"])
def test_four_processes_on_one_gpu(hopper, root, mode):
    worker = pathlib.Path(__file__).with_name("_mp_worker.py")
    port = _free_port()
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ)
        env.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
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
    for r in range(WORLD):
        assert "rank %d of %d: ok" % (r, WORLD) in outputs[r], report
