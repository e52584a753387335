"""moelora.models.shapes: named config.json contents for load_format="dummy" runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moelora.errors import ConfigError
from moelora.models.registry import read_model_config
from moelora.models.shapes import MXFP4_QUANTIZATION, SHAPES, shape_config, write_config_folder


@pytest.mark.parametrize("name", list(SHAPES))
def test_each_shape_reads_as_a_model_config(name: str, tmp_path: Path) -> None:
    folder = write_config_folder(shape_config(name, num_layers=1), tmp_path)
    model_config, _ = read_model_config(str(folder))
    assert model_config.num_layers == 1
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 1
    assert shape_config(name)["num_hidden_layers"] == SHAPES[name]["num_hidden_layers"]


def test_the_qwen3_30b_a3b_shape_is_the_benchmarks_one(tmp_path: Path) -> None:
    model_config, _ = read_model_config(str(write_config_folder(SHAPES["qwen3-30b-a3b"], tmp_path)))
    assert (model_config.num_layers, model_config.num_experts, model_config.top_k) == (48, 128, 8)
    assert (model_config.hidden_size, model_config.moe_intermediate_size) == (2048, 768)


@pytest.mark.parametrize(
    "name,layers,experts", [("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)]
)
def test_the_gpt_oss_shapes_are_the_releases(tmp_path: Path, name, layers, experts) -> None:
    cfg, _ = read_model_config(str(write_config_folder(SHAPES[name], tmp_path)))
    assert (cfg.arch, cfg.num_layers, cfg.num_experts, cfg.top_k) == ("gpt_oss", layers, experts, 4)
    assert (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_heads, cfg.head_dim) == (
        2880,
        2880,
        64,
        64,
    )
    assert cfg.sliding_window == 128 and cfg.sliding_layers[:2] == (True, False)
    three, _ = read_model_config(
        str(write_config_folder(shape_config(name, num_layers=3), tmp_path))
    )
    assert three.sliding_layers == (True, False, True)


def test_a_gpt_oss_shape_with_the_releases_quantization_has_mxfp4_experts(tmp_path: Path) -> None:
    config = {**shape_config("gpt-oss-120b"), "quantization_config": dict(MXFP4_QUANTIZATION)}
    cfg, _ = read_model_config(str(write_config_folder(config, tmp_path)))
    assert cfg.experts_mxfp4
    plain, _ = read_model_config(str(write_config_folder(shape_config("gpt-oss-120b"), tmp_path)))
    assert not plain.experts_mxfp4


def test_a_copy_leaves_the_shape_as_it_is() -> None:
    shape_config("qwen3-30b-a3b")["architectures"].append("x")
    assert shape_config("qwen3-30b-a3b")["architectures"] == ["Qwen3MoeForCausalLM"]


def test_an_unknown_shape_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"shape 'nope' is unknown: expected one of qwen3-30b"):
        shape_config("nope")
