"""bench/decode.py on the CPU: its ratio table's MLA column (8 distinct over the same without
kv_b_proj's LoRA) only where that case ran, each cell a graph time over its reference's; and
the decode step it measures is one token a request, also for a hybrid model whose prompts
prefill in two chunks (prefix caching's state snapshot boundary)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = 4


@pytest.fixture
def decode(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # as `python bench/decode.py` has it
    import decode

    return decode


def _rows(cases: dict[str, float], B: int = 8) -> list[tuple]:
    return [(case, B, ms, None, 1.0, 1.0) for case, ms in cases.items()]


def test_the_kv_b_column_only_where_its_case_ran(decode):
    times = {"disabled": 2.0, "base-only": 2.2, "8 distinct": 3.3}
    plain = decode.ratio_table(_rows(times), [8])
    assert plain[1] == "| B | base-only / disabled | 8 distinct / disabled |"
    assert plain[-1] == "| 8 | 1.100 | 1.650 |"
    mla = decode.ratio_table(_rows({**times, decode.NO_KV_B: 3.0}), [8])
    assert mla[1].endswith("| 8 distinct / no kv_b |") and mla[2] == "|---:|---:|---:|---:|"
    assert mla[-1] == "| 8 | 1.100 | 1.650 | 1.100 |"


def test_a_missing_case_leaves_its_cell_empty(decode):
    rows = _rows({"disabled": 2.0, "8 distinct": 3.0}, B=1)
    assert decode.ratio_table(rows, [1, 64])[-2:] == ["| 1 |  | 1.500 |", "| 64 |  |  |"]


def test_the_planned_step_decodes_after_a_hybrid_prompts_two_chunks(decode, tmp_path: Path) -> None:
    import common
    import qwen3_next_fixtures as qf
    from family_fixtures import FamilyFixtures

    fx = FamilyFixtures(tmp_path, qf, "cpu", max_loras=2, max_lora_rank=8, max_num_seqs=4)
    engine = fx.llm("qwen3_5_moe", page_size=PAGE, enable_prefix_caching=True).engine
    # 4 pages: the first chunk ends at the last boundary before the last token (12), the
    # second holds 4 tokens a request, as many as a decode step of B=4 would hold in all
    step = common.decode_batch(engine, 3, [None, "a", None], context=4 * PAGE)
    assert len(step.request_ids) == 3 and step.inputs.num_tokens == 3
    running = {req.request_id: req for req in engine.scheduler.running}
    assert all(running[rid].num_computed_tokens >= 4 * PAGE for rid in step.request_ids)


def test_case_names_take_underscores_for_spaces(decode):
    """--cases 8_distinct reaches the script through gpu-check's $DECODE_ARGS unquoted."""
    args = decode.parse_args(
        ["--cases", "disabled", "base-only", "8_distinct", "8_distinct,_no_kv_b"]
    )
    assert args.cases == ["disabled", "base-only", "8 distinct", "8 distinct, no kv_b"]
