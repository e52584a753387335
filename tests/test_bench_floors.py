"""The decode floors' attention bytes (bench/common.py attention_shapes, cache_bytes) for the
families whose attention is not GQA: every projection a layer's attention or gated DeltaNet
holds in transformers' own model of a tiny fixture, and the caches and states a step moves."""

from __future__ import annotations

from pathlib import Path

import hf_fixtures as hf
import mla_fixtures as mf
import pytest
import qwen3_next_fixtures as qf
import torch

from moelora.models.registry import read_model_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def common(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # as `python bench/decode.py` has it
    import common

    return common


def linear_shapes(module: torch.nn.Module) -> list[tuple[int, int]]:
    return sorted(
        (m.in_features, m.out_features) for m in module.modules() if isinstance(m, torch.nn.Linear)
    )


@pytest.mark.parametrize(
    "fixtures,arch", [*((mf, a) for a in mf.ARCHS), *((qf, a) for a in qf.ARCHS)]
)
def test_attention_shapes_are_transformers_projections(
    common, fixtures, arch, tmp_path: Path
) -> None:
    folder = fixtures.make_model(arch, tmp_path / arch, seed=1)
    mc, _ = read_model_config(str(folder))
    model = hf.load_hf_model(folder)
    kinds = set()
    for i, layer in enumerate(model.model.layers):
        attention = getattr(layer, "linear_attn", None) or layer.self_attn
        kinds.add(type(attention).__name__)
        assert sorted(common.attention_shapes(mc, i)) == linear_shapes(attention), (arch, i)
    assert len(kinds) == (2 if fixtures is qf else 1), kinds  # the hybrids: both kinds met


def test_a_hybrid_step_moves_its_paged_kv_each_state_twice_and_its_weights(
    common, tmp_path: Path
) -> None:
    folder = qf.make_model("qwen3_next", tmp_path / "m", seed=1)
    mc, _ = read_model_config(str(folder))
    paged = [i for i in range(mc.num_layers) if not mc.linear_attention.layers[i]]
    assert 0 < len(paged) < mc.num_layers
    seq_lens = torch.tensor([3, 5, 9])
    kv = len(paged) * 17 * 2 * mc.num_kv_heads * mc.head_dim * 2
    assert common.cache_bytes(mc, seq_lens) == kv + 2 * 3 * mc.state_slot_bytes(torch.bfloat16)
    assert common.weight_bytes(mc, [mc.num_experts] * sum(mc.sparse_layers)) == held_bytes(folder)


def held_bytes(folder: Path) -> int:
    """The bf16 bytes of every weight transformers' model of `folder` holds but the embedding
    (a step reads B rows of it) and the vectors (norms, dt_bias, A_log, the shared expert's
    1-row gate, the routers' correction bias)."""
    model = hf.load_hf_model(folder)
    small = ("norm", "dt_bias", "A_log", "shared_expert_gate", "embed_tokens", "correction_bias")
    held = (p for n, p in model.named_parameters() if not any(k in n for k in small))
    return 2 * sum(p.numel() for p in held)


def test_an_mla_step_reads_the_latent_and_rotary_key(common, tmp_path: Path) -> None:
    folder = mf.make_model("deepseek_v3", tmp_path / "m", seed=1)
    mc, _ = read_model_config(str(folder))
    per_token = mc.mla.kv_lora_rank + mc.mla.qk_rope_head_dim
    assert common.cache_bytes(mc, torch.tensor([4, 6])) == mc.num_layers * 10 * per_token * 2
    assert common.weight_bytes(mc, [mc.num_experts] * sum(mc.sparse_layers)) == held_bytes(folder)


def test_prefill_flops(common, tmp_path: Path) -> None:
    """GQA's as before the per-layer attention (Qwen3-30B-A3B's shape); MLA layers count their
    expanded heads' two products, gated DeltaNet layers their state's three, not GQA's."""
    from moelora.models.shapes import shape_config, write_config_folder

    folder = write_config_folder(shape_config("qwen3-30b-a3b", num_layers=2), tmp_path / "q")
    cfg, _ = read_model_config(str(folder))
    H, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    per_layer = H * (q + 2 * kv) + q * H + H * cfg.num_experts
    per_layer += cfg.top_k * 3 * H * cfg.moe_intermediate_size
    want = 2 * 2 * per_layer * 100 + 2 * 2 * q * 2 * 100 * 101 / 2 + 2 * H * cfg.vocab_size
    assert common.prefill_flops(cfg, [100]) == want

    for fixtures, arch in ((mf, "deepseek_v3"), (qf, "qwen3_next")):
        cfg, _ = read_model_config(str(fixtures.make_model(arch, tmp_path / arch, seed=1)))
        rest = 2 * common.active_params(cfg) * 30 + 2 * cfg.hidden_size * cfg.vocab_size
        if cfg.mla is not None:
            m, pairs = cfg.mla, 30 * 31 / 2
            want = cfg.num_layers * 2 * cfg.num_heads * (m.qk_head_dim + m.v_head_dim) * pairs
        else:
            la = cfg.linear_attention
            state = 30 * 6 * la.num_v_heads * la.head_k_dim * la.head_v_dim * sum(la.layers)
            want = state + cfg.num_paged_layers * 4 * cfg.q_size * 30 * 31 / 2
        assert common.prefill_flops(cfg, [30]) == rest + want, arch
