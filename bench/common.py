"""What every benchmark shares: the copy-bandwidth ceiling, graph timing, the commit, the result
header."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys

import torch


def copy_bandwidth(gib: int = 2) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read and written."""
    from triton.testing import do_bench

    src = torch.empty(gib << 29, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def graph_ms(fn, layers: int) -> float:
    """Median ms of one layer: fn() runs all layers; replays of its CUDA graph, L2 flushed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    from triton.testing import do_bench

    ms = do_bench(graph.replay, warmup=10, rep=60, return_mode="median")
    del graph
    return ms / layers


def commit() -> str:
    """The commit benchmarked: MOELORA_COMMIT when the tree travelled without .git."""
    if os.environ.get("MOELORA_COMMIT"):
        return os.environ["MOELORA_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def result_header(title: str, bandwidth: float | None) -> list[str]:
    import triton

    lines = [
        f"# {title}",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- commit: {commit()}",
        f"- device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"triton {triton.__version__}",
        f"- command: `PYTHONPATH=. python {' '.join(sys.argv)}`",
    ]
    if bandwidth is not None:
        lines.append(f"- copy bandwidth (D2D, read + write): {bandwidth / 1e12:.2f} TB/s")
    return lines
