"""Programmatic dependent launch (PDL): each Triton kernel of a step may be launched while the
kernel before it is still running, and waits for it on the device instead.

Why: a decode step at one token is a chain of about 15 small kernels per layer, and each
CUDA-graph node costs launch and drain time even when its kernel does nothing (DESIGN.md).
With PDL the next grid is set up while the last one finishes.

The contract that keeps this correct: a kernel launched with `launch_pdl` calls `pdl_wait`
first, before any load, store or early return. `gdc_wait` blocks until the grid before it
has completed and its memory is visible, so every kernel still sees all the writes of every
kernel before it (each one waited for its own predecessor). `gdc_launch_dependents` right
after lets the next kernel's launch start at once; it only waits there.

Hopper (sm_90) and later only; the interpreter and older GPUs launch without it. Set
MOELORA_PDL=0 to turn it off (read once per process; for A/B benchmarks).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """The first statement of every kernel launched through `pdl_kwargs`."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def pdl_kwargs(device: torch.device) -> dict[str, bool]:
    """Launch keywords for a kernel on `device`: the kernel's PDL constexpr, and Triton's
    launch_pdl option where the device supports it."""
    return {"PDL": True, "launch_pdl": True} if _supported(device) else {"PDL": False}


@functools.cache
def _supported(device: torch.device) -> bool:
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get("MOELORA_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9
