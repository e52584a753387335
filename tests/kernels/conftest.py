"""Run this folder's Triton kernels in the interpreter, on the CPU.

triton.jit picks the interpreter when a kernel is *decorated*, so the variable must be set
before any moelora.kernels module that defines kernels is imported: conftest.py is imported
before the test modules of its folder. Nothing else in the CPU suite uses Triton, so the
variable staying set for the rest of the process is harmless.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def poison_empty(monkeypatch):
    """torch.empty returns NaN (floats) or -7 (ints): a kernel must write every output element it
    owns, and must not read scratch it did not write."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else -7)

    monkeypatch.setattr(torch, "empty", poisoned)
