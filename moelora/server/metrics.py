"""Server metrics in the Prometheus text format (version 0.0.4), without a client library.

Counters and histograms are written by the engine thread and read by the HTTP thread, so each
family takes a lock. Gauges (running requests, KV pages, adapter slots, GPU memory) are not
stored here: they come from `Engine.stats()` at scrape time, and the process's resident memory
from /proc/self/statm.
"""

from __future__ import annotations

import math
import os
import threading
from bisect import bisect_left
from collections.abc import Iterable
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

Labels = tuple[tuple[str, str], ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Labels, extra: tuple[str, str] | None = None) -> str:
    pairs = [*labels, extra] if extra else list(labels)
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"


def _number(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class CounterFamily:
    def __init__(self, name: str, help_: str):
        self.name, self.help = name, help_
        self._values: dict[Labels, float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} counter"
        with self._lock:
            for labels, value in sorted(self._values.items()):
                yield f"{self.name}{_labels(labels)} {_number(value)}"


class Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_, buckets
        self._counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect_left(self.buckets, value)] += 1
            self._sum += value

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative = 0
        for bound, count in zip([*self.buckets, math.inf], counts):
            cumulative += count
            yield f'{self.name}_bucket{{le="{_number(bound)}"}} {cumulative}'
        yield f"{self.name}_sum {_number(total)}"
        yield f"{self.name}_count {cumulative}"


def resident_memory_bytes() -> int | None:
    """This process's resident set size (Linux's /proc/self/statm; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def _gauge(name: str, help_: str, value: float, kind: str = "gauge") -> Iterable[str]:
    yield f"# HELP {name} {help_}"
    yield f"# TYPE {name} {kind}"
    yield f"{name} {_number(value)}"


class ServerMetrics:
    def __init__(self) -> None:
        self.requests = CounterFamily(
            "moelora_requests_total", "Finished requests by model (base or adapter) and status."
        )
        self.prompt_tokens = CounterFamily(
            "moelora_prompt_tokens_total", "Prompt tokens of admitted requests, by model."
        )
        self.generation_tokens = CounterFamily(
            "moelora_generation_tokens_total", "Generated tokens, by model."
        )
        self.ttft = Histogram(
            "moelora_time_to_first_token_seconds",
            "From a request's arrival at the engine to its first generated token.",
            TTFT_BUCKETS,
        )
        self.itl = Histogram(
            "moelora_inter_token_latency_seconds",
            "Time between consecutive generated tokens of one request.",
            ITL_BUCKETS,
        )

    def render(self, stats: Any, num_loras: int) -> str:
        """`stats` is an EngineStats snapshot taken on the engine thread."""
        lines: list[str] = []
        for family in (self.requests, self.prompt_tokens, self.generation_tokens):
            lines += family.render()
        lines += self.ttft.render()
        lines += self.itl.render()
        for name, help_, field in ENGINE_GAUGES:
            lines += _gauge(name, help_, getattr(stats, field))
        lines += _gauge(
            "moelora_loras_registered",
            "Adapters registered (in a slot or in host memory).",
            num_loras,
        )
        rss = resident_memory_bytes()
        if rss is not None:  # the Prometheus client libraries' standard name
            lines += _gauge("process_resident_memory_bytes", "Resident memory size in bytes.", rss)
        for name, help_, field in ENGINE_COUNTERS:
            lines += _gauge(name, help_, getattr(stats, field), "counter")
        lines += _adapter_lines(stats.adapters)
        return "\n".join(lines) + "\n"


def _adapter_lines(adapters: Iterable[Any]) -> Iterable[str]:
    """Per adapter, where it lives and its queued requests: what a router needs to send a
    request where its adapter already is (vLLM's proposed vllm:lora_adapter_loaded)."""
    adapters = list(adapters)
    families = (
        (
            "moelora_lora_adapter_loaded",
            "1 for each adapter, labelled with where it lives: "
            "gpu (in a slot), cpu (host memory) or disk (its folder only, or being read).",
            lambda a: 1,
            True,
        ),
        (
            "moelora_lora_adapter_requests_running",
            "Running requests of each adapter.",
            lambda a: a.num_running,
            False,
        ),
        (
            "moelora_lora_adapter_requests_waiting",
            "Waiting requests of each adapter.",
            lambda a: a.num_waiting,
            False,
        ),
    )
    for name, help_, value, with_level in families:
        yield f"# HELP {name} {help_}"
        yield f"# TYPE {name} gauge"
        for a in adapters:
            labels: Labels = (("adapter", a.name),) + ((("level", a.level),) if with_level else ())
            yield f"{name}{_labels(labels)} {_number(value(a))}"


# (name, help, EngineStats field) of what the engine's stats give at scrape time
ENGINE_GAUGES = (
    ("moelora_num_requests_running", "Requests in the running batch.", "num_running"),
    ("moelora_num_requests_waiting", "Requests waiting for a batch.", "num_waiting"),
    (
        "moelora_kv_pages_used",
        "KV cache pages requests hold (a cached page no request holds is free).",
        "kv_pages_used",
    ),
    (
        "moelora_kv_pages_cached",
        "KV cache pages in the prefix cache, held by a request or not.",
        "kv_pages_cached",
    ),
    ("moelora_kv_pages_total", "KV cache pages in all.", "kv_pages_total"),
    ("moelora_lora_slots_used", "Adapter slots holding an adapter.", "lora_slots_used"),
    ("moelora_lora_slots_total", "Adapter slots in all.", "lora_slots_total"),
    (
        "moelora_lora_slot_refs",
        "References to adapter slots, one per request holding a slot (0 when idle).",
        "lora_slot_refs",
    ),
    (
        "moelora_state_slots_used",
        "Hybrid models: recurrent-state slots requests hold (0 when idle; 0 of 0 otherwise).",
        "state_slots_used",
    ),
    (
        "moelora_state_slots_total",
        "Hybrid models: recurrent-state slots in all.",
        "state_slots_total",
    ),
    (
        "moelora_state_snapshots_cached",
        "Hybrid models: prefix-cache state snapshots at page boundaries.",
        "state_snapshots_cached",
    ),
    (
        "moelora_state_snapshots_total",
        "Hybrid models: state snapshot rows in all (--max-state-snapshots).",
        "state_snapshots_total",
    ),
    (
        "moelora_gpu_memory_allocated_bytes",
        "Bytes torch has allocated on the engine's GPU (0 on the CPU).",
        "gpu_memory_allocated",
    ),
)
ENGINE_COUNTERS = (
    ("moelora_graph_replays_total", "Decode steps run by CUDA graph replay.", "graph_replays"),
    ("moelora_eager_steps_total", "Steps run eagerly (prefill, or no graph).", "eager_steps"),
    (
        "moelora_prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache at admission.",
        "prefix_cache_queries",
    ),
    (
        "moelora_prefix_cache_hits_total",
        "Prompt tokens found in the prefix cache (their KV not computed again).",
        "prefix_cache_hits",
    ),
    ("moelora_lora_fills_total", "Adapters copied into a GPU slot.", "lora_fills"),
    (
        "moelora_lora_fill_bytes_total",
        "Bytes of the adapters copied into slots.",
        "lora_fill_bytes",
    ),
    (
        "moelora_lora_fill_seconds_total",
        "The engine thread's seconds in slot fills (every running stream waits for them).",
        "lora_fill_seconds",
    ),
)
