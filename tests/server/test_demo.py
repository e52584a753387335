"""The demo assets: written once, deterministically, atomically, and loadable by transformers."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from safetensors import safe_open

from moelora import demo


def _digest(root: Path) -> dict[str, str]:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> demo.DemoAssets:
    return demo.ensure_demo(tmp_path_factory.mktemp("demo") / "demo")


def test_demo_is_deterministic_and_written_once(assets: demo.DemoAssets, tmp_path: Path) -> None:
    root = assets.model.parent
    again = demo.ensure_demo(tmp_path / "demo")
    assert _digest(root) == _digest(again.model.parent)
    before = (assets.model / "model.safetensors").stat().st_mtime_ns
    demo.ensure_demo(root)
    assert (assets.model / "model.safetensors").stat().st_mtime_ns == before
    assert not [p for p in root.parent.iterdir() if ".tmp-" in p.name]


def test_incomplete_demo_is_rebuilt(tmp_path: Path) -> None:
    root = tmp_path / "demo"
    (root / "model").mkdir(parents=True)  # what a crash before the marker would look like
    assets = demo.ensure_demo(root)
    assert (assets.model / "model.safetensors").is_file()
    assert (root / demo.MARKER).read_text().strip() == demo.DEMO_VERSION


def test_transformers_reads_tokenizer_and_config(assets: demo.DemoAssets) -> None:
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets.model)
    text = "SELECT name FROM users WHERE age > 30; héllo ✓"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    config = AutoConfig.from_pretrained(assets.model)
    assert config.model_type == "qwen3_moe"
    assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
    assert config.vocab_size == len(tok) and config.eos_token_id == tok.eos_token_id


def test_adapter_layouts(assets: demo.DemoAssets) -> None:
    shape = demo.DEMO_SHAPE
    e, h, i = shape.experts, shape.hidden, shape.expert_intermediate
    sql = assets.adapters["sql"]
    assert json.loads((sql / "adapter_config.json").read_text())["r"] == 8
    with safe_open(sql / "adapter_model.safetensors", "pt") as f:
        p = "base_model.model.model.layers.1.mlp.experts.7."
        assert f.get_slice(p + "gate_proj.lora_A.weight").get_shape() == [8, h]
        assert f.get_slice(p + "down_proj.lora_B.weight").get_shape() == [h, 8]
    chat = assets.adapters["chat"]
    config = json.loads((chat / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    with safe_open(chat / "adapter_model.safetensors", "pt") as f:
        p = "base_model.model.model.layers.0.mlp.experts."
        assert f.get_slice(p + "base_layer.lora_A.weight").get_shape() == [4 * e, h]
        assert f.get_slice(p + "base_layer.lora_B.weight").get_shape() == [2 * i, 4 * e]
        assert f.get_slice(p + "lora_A.weight").get_shape() == [4 * e, i]
        assert f.get_slice(p + "lora_B.weight").get_shape() == [h, 4 * e]
        assert f.get_tensor(p + "lora_B.weight").abs().min() > 0
