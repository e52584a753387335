"""Capturing a step in a CUDA graph, as the GPU tests that replay kernels with new inputs do."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def capture(step: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(graph, step's outputs inside it). step runs once on a side stream first, so Triton
    compiles outside the capture, then once more under capture; replay the graph after writing
    new inputs in place and read the returned outputs."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
