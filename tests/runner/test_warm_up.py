"""The graph runner's warm-up runs every batch size's forward at once, under one Triton
AsyncCompileMode, so kernel variants compile side by side (a cold capture is mostly compiling)."""

import threading

import pytest
from triton.runtime import _async_compile

from moelora.runner.graph_runner import warm_up_concurrently


def test_every_size_runs_once_all_at_the_same_time_under_one_compile_mode():
    sizes = [32, 24, 16, 8, 4, 2, 1]
    together = threading.Barrier(len(sizes), timeout=30)  # broken if the forwards run one by one
    seen, lock = {}, threading.Lock()

    def forward(bs: int) -> None:
        together.wait()
        mode = _async_compile.active_mode.get()
        # a compile submitted here runs in the pool, not on the forward's thread
        compiled = mode.submit(("variant", bs), threading.get_ident, lambda kernel: None)
        with lock:
            seen[bs] = (threading.get_ident(), mode, compiled.result())

    assert warm_up_concurrently(forward, sizes, compile_threads=2)
    assert sorted(seen) == sorted(sizes)
    threads = {thread for thread, _, _ in seen.values()}
    assert len(threads) == len(sizes) and threading.get_ident() not in threads
    assert len({id(mode) for _, mode, _ in seen.values()}) == 1
    assert all(compiler not in threads for _, _, compiler in seen.values())
    assert _async_compile.active_mode.get() is None  # nothing left behind


def test_a_failing_forward_raises_in_the_caller_after_the_others_finish():
    finished = []

    def forward(bs: int) -> None:
        if bs == 2:
            raise ValueError("bs 2 failed")
        finished.append(bs)

    with pytest.raises(ValueError, match="bs 2 failed"):
        warm_up_concurrently(forward, [4, 2, 1], compile_threads=1)
    assert sorted(finished) == [1, 4]
    assert _async_compile.active_mode.get() is None
