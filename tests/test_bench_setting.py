"""bench/setting.py: a kernels' module setting made before a benchmark runs (the A/B of a
constant or a config field in one device call), and its refusals."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import setting  # noqa: E402

from moelora.kernels.attention import mla_absorb  # noqa: E402
from moelora.kernels.linear_attention import delta_chunked  # noqa: E402


def test_a_constant_and_a_config_field(monkeypatch):
    monkeypatch.setattr(mla_absorb, "FILL", mla_absorb.FILL)
    monkeypatch.setattr(delta_chunked, "CONFIG", delta_chunked.CONFIG)
    before = delta_chunked.CONFIG
    setting.apply("moelora.kernels.attention.mla_absorb.FILL=7")
    setting.apply("moelora.kernels.linear_attention.delta_chunked.CONFIG.num_stages=5")
    assert mla_absorb.FILL == 7
    assert delta_chunked.CONFIG.num_stages == 5 and delta_chunked.CONFIG.chunk == before.chunk
    assert before.num_stages != 5  # replaced, the frozen original untouched


@pytest.mark.parametrize(
    "bad",
    [
        "moelora.kernels.attention.mla_absorb.FILL",  # no value
        "moelora.config.EngineConfig=1",  # not a kernels module
        "moelora.kernels.attention.mla_absorb.NO_SUCH=1",
        "moelora.kernels.attention.mla_absorb.FILL=not a literal",
        "moelora.kernels.linear_attention.delta_chunked.CONFIG.no_field=1",
    ],
)
def test_refusals_name_the_setting(bad):
    with pytest.raises(SystemExit, match="expected|no |literal|moelora.config"):
        setting.apply(bad)
