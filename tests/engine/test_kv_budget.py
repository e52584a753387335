"""The KV-budget refusal states sizes a reader can compare: a tiny model's sequence needs less
than 1 MiB, which whole MiB would round to 0."""

from __future__ import annotations

from moelora.engine.build import kv_budget_refusal


def test_sizes_under_one_mib_are_in_bytes() -> None:
    message = str(kv_budget_refusal(0.5, -3 * 2**20, 24_576))
    assert "expected at least 24576 bytes (one sequence of max_model_len)" in message
    assert "leaves -3.0 MiB for the KV cache" in message


def test_sizes_from_one_mib_are_in_mib() -> None:
    message = str(kv_budget_refusal(0.9, 1000, 3 * 2**20 + 2**19))
    assert message == (
        "gpu_memory_utilization=0.9 leaves 1000 bytes for the KV cache, expected at least "
        "3.5 MiB (one sequence of max_model_len)"
    )
