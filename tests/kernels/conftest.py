"""Run this folder's Triton kernels in the interpreter, on the CPU.

triton.jit picks the interpreter when a kernel is *decorated*, so the variable must be set
before any moelora.kernels module that defines kernels is imported: conftest.py is imported
before the test modules of its folder. Nothing else in the CPU suite uses Triton, so the
variable staying set for the rest of the process is harmless.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402


def _index_fix(original):
    """Triton 3.6's interpreter turns scalars into Python ints with int(array of shape [1]),
    which NumPy >= 2.4 rejects (any range() over a runtime bound fails). Convert via .item()."""

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).item()))

    return patch


if tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 4):
    interpreter._patch_lang_tensor = _index_fix(interpreter._patch_lang_tensor)


@pytest.fixture
def poison_empty(monkeypatch):
    """torch.empty returns NaN (floats) or -7 (ints): a kernel must write every output element it
    owns, and must not read scratch it did not write."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else -7)

    monkeypatch.setattr(torch, "empty", poisoned)
