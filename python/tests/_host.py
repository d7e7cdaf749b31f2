"""Helpers of the host tests that drive tilewire's torch modules on the CPU: a fake comm and a
guard that fails any call into the C library. Imported after pytest.importorskip("torch")."""

import torch

from tilewire import _lib


class FakeComm:
    """rank and size of a comm, and CPU stand-ins for the calls the modules make on it:
    symmetric tensors (zeros, their shapes recorded in allocs) and the workspace sizes."""

    def __init__(self, rank=0, size=1):
        self.rank, self.size, self.device = rank, size, 0
        self.allocs = []

    def empty(self, shape, dtype=None):
        t = torch.zeros(shape, dtype=dtype or torch.bfloat16)
        self.allocs.append(tuple(t.shape))
        return t

    def gemm_rs_workspace_size(self, m, n):
        return 4 * m * n

    def moe_workspace_size(self, max_tokens, experts, top_k, hidden):
        return 64


def forbid_library(monkeypatch):
    """Any call into the C library fails the test."""
    def refuse(name, *args, **kwargs):
        raise AssertionError("called the library: %s" % name)
    monkeypatch.setattr(_lib, "call", refuse)
    monkeypatch.setattr(_lib, "function", refuse)
