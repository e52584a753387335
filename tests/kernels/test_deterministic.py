"""Deterministic inference's kernels (EngineConfig.enable_deterministic_inference), in the
interpreter in fp32: a row's bits do not follow what shares its step. The interpreter cannot
show the GPU's instruction shapes (mma.sync against warpgroup MMAs round differently; see
tests/gpu for bf16 on the device); these cases catch the paths that change with the step here
too: the MoE LoRA shrinks by pair or by block, the decode attention's split path against the
prefill kernel's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from lora_cases import batch_info, lora_weights
from test_paged_attention import make_step

from moelora.config import EngineConfig
from moelora.errors import ConfigError
from moelora.kernels import gated_delta, reference
from moelora.kernels.attention.paged import launch_paged_attention, plan_attention
from moelora.kernels.moe import fused as module
from moelora.kernels.moe.fused import fused_moe
from moelora.kernels.ops import make_ops
from moelora.step.lora import LoraBatchInfo

H, I, E, K = 64, 32, 8, 2


def moe_rows(T: int, seed: int):
    """T tokens on mixed slots (some base), their routing and both LoRA halves."""
    torch.manual_seed(seed)
    x = torch.randn(T, H)
    w13 = torch.randn(E, 2 * I, H) / H**0.5
    w2 = torch.randn(E, H, I) / I**0.5
    topk_weights, topk_ids = reference.route_topk(torch.randn(T, E), K, renormalize=True)
    info = batch_info(T, "mixed")
    ranks = info.rank_of_slot
    lora = dict(
        lora13=lora_weights(info.num_slots, (E,), 2, 16, H, (I, I), ranks, torch.float32),
        lora2=lora_weights(info.num_slots, (E,), 1, 16, I, (H,), ranks, torch.float32),
        info=info,
    )
    return (x, w13, w2, topk_weights, topk_ids), lora


def rows_of(args, lora, rows: slice):
    """The same tokens alone: their rows of x and routing, their slots, only their slots on."""
    x, w13, w2, topk_weights, topk_ids = args
    info = lora["info"]
    slots = info.slot_of_token[rows]
    enabled = torch.zeros_like(info.slot_enabled)
    for s in slots.tolist():
        if s >= 0 and info.rank_of_slot[s] > 0:
            enabled[s] = 1
    alone = LoraBatchInfo(slots, info.rank_of_slot, info.scaling_of_slot, enabled)
    args = (x[rows], w13, w2, topk_weights[rows], topk_ids[rows])
    return args, dict(lora, info=alone)


def test_moe_rows_alone_and_batched_give_the_same_bits(poison_empty, monkeypatch):
    """With a block-shrink threshold between the two steps' pair counts (as at 2049 pairs on
    the GPU), the batched step shrinks block by block and the lone one by pair unless
    deterministic: then both by block (the lone one a program a slot), the same bits. The tiles
    are deterministic_config's. Both shrinks take 32-deep chunks here: numpy sums a chunk as a
    whole, where the GPU's chain of k16 MMAs is the same at any chunk (tests/gpu)."""
    monkeypatch.setattr(module, "BLOCK_SHRINK_FROM", 12)
    monkeypatch.setattr(module, "BLOCK_SHRINK_K", 32)
    monkeypatch.setattr(module, "SLOT_SHRINK_K", 32)
    args, lora = moe_rows(24, seed=3)
    batched = fused_moe(*args, **lora, deterministic=True)
    alone_args, alone_lora = rows_of(args, lora, slice(5, 8))  # 6 pairs: under the threshold
    alone = fused_moe(*alone_args, **alone_lora, deterministic=True)
    assert torch.isfinite(batched).all()
    assert torch.equal(alone, batched[5:8])
    assert torch.allclose(batched, reference.fused_moe(*args, **lora), rtol=1e-4, atol=1e-5)


def test_deterministic_moe_tiles():
    cfg = module.deterministic_config(module.MoeConfig(block_m=16, block_k=256, block_k_down=64))
    assert (cfg.block_m, cfg.block_k, cfg.block_k_down) == (16, 128, 128)
    assert (cfg.num_stages, cfg.num_stages_down) == (3, 3)  # 3 x 36 KiB fit: kept
    wide = module.deterministic_config(module.MoeConfig(block_m=128, block_n=32))
    assert (wide.block_m, wide.block_n, wide.block_k) == (128, 32, 128)  # rows, columns kept


def test_deterministic_moe_tiles_made_deeper_stage_what_fits():
    """Mixtral's prefill bucket (64 x 128 tiles 64 deep, 3 stages) made 128 deep: gate_up's
    3 x 80 KiB would not fit a Hopper block's 227 KiB (Triton refused it), 2 do; down's 3 x
    48 KiB do. Stages change no sum, only the pipeline's depth."""
    tuned = module.MoeConfig(64, 128, 64, 128, 64, num_warps=8, num_stages=3)
    cfg = module.deterministic_config(tuned)
    assert (cfg.block_k, cfg.block_k_down, cfg.num_stages, cfg.num_stages_down) == (128, 128, 2, 3)
    assert cfg.num_stages * (64 + 2 * 128) * 128 * 2 <= module.STAGE_BYTES
    huge = module.deterministic_config(module.MoeConfig(256, 256, 64, 256, 64, num_stages=4))
    assert (huge.num_stages, huge.num_stages_down) == (2, 2)  # never fewer than 2


def test_decode_rows_alone_and_beside_a_prefill_chunk_give_the_same_bits():
    """A decode step's rows against the same rows in a step with another sequence's chunk:
    deterministic, both take the prefill kernel (unsplit, its tiles), the same bits."""
    q_lens, seq_lens = [17, 1, 1], [50, 300, 45]
    q, k_cache, v_cache, mixed = make_step(
        q_lens,
        seq_lens,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        page_size=16,
        dtype=torch.float32,
    )
    decode = dataclasses.replace(
        mixed,
        cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=mixed.seq_lens[1:],
        page_table=mixed.page_table[1:],
        slot_mapping=mixed.slot_mapping[17:],
        max_query_len=1,
    )
    scale = 16**-0.5
    both, _ = launch_paged_attention(q, k_cache, v_cache, mixed, scale, deterministic=True)
    planned = plan_attention(decode, 2, 4, 2, 16, deterministic=True)
    assert planned.work is not None  # the decode step's work table, built once for its layers
    alone, _ = launch_paged_attention(q[17:], k_cache, v_cache, planned, scale, deterministic=True)
    assert torch.isfinite(alone).all()
    assert torch.equal(alone, both[17:])
    expected = reference.paged_attention(
        q[17:], k_cache.nan_to_num(), v_cache.nan_to_num(), decode, scale
    )
    torch.testing.assert_close(alone, expected, atol=1e-5, rtol=1e-5)


def test_the_deterministic_table_and_its_config():
    cuda = torch.device("cuda")  # make_ops only reads the type: no GPU is touched
    ops = make_ops(cuda, deterministic=True)  # the default backend asks for cuDNN: not taken
    assert ops.name == "triton-auto-deterministic" and not ops.linear.skinny
    assert ops.fused_moe.keywords == {"deterministic": True}
    assert ops.paged_attention.keywords == {"dense_from": 0, "deterministic": True}
    assert ops.paged_attention_o_shrink.keywords == {"dense_from": 0, "deterministic": True}
    assert ops.plan_attention.keywords == {"deterministic": True}
    assert make_ops(torch.device("cpu"), deterministic=True).name == "torch"
    with pytest.raises(ConfigError, match="projections='skinny' is invalid: expected "):
        EngineConfig(model="demo", projections="skinny", enable_deterministic_inference=True)
    for projections in ("auto", "batch-invariant"):  # auto then takes the batch-invariant
        EngineConfig(model="demo", projections=projections, enable_deterministic_inference=True)


def test_the_prefill_forms_and_their_configs():
    """linear_attention_prefill="chunked" binds the Triton delta rule's chunked=True and
    mla_prefill="expanded" sets Ops.mla_expanded_prefill; deterministic keeps neither; the
    references' delta rule has no block form (the CPU always runs the token loop); a value
    outside the choices is refused by name."""
    from moelora.engine.ranks import make_rank_ops
    from moelora.parallel import SINGLE

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    asked = dict(mla_prefill="expanded", linear_attention_prefill="chunked")
    ops = make_rank_ops(EngineConfig(model="demo", **asked), SINGLE, cuda)
    assert ops.gated_delta_rule.keywords == {"chunked": True} and ops.mla_expanded_prefill
    exact = EngineConfig(model="demo", enable_deterministic_inference=True, **asked)
    ops = make_rank_ops(exact, SINGLE, cuda)
    assert not hasattr(ops.gated_delta_rule, "keywords") and not ops.mla_expanded_prefill
    default = make_rank_ops(EngineConfig(model="demo"), SINGLE, cuda)
    assert default.gated_delta_rule.keywords == {"chunked": True} and default.mla_expanded_prefill
    asked = dict(mla_prefill="absorbed", linear_attention_prefill="recurrent")
    ops = make_rank_ops(EngineConfig(model="demo", **asked), SINGLE, cuda)
    assert not hasattr(ops.gated_delta_rule, "keywords") and not ops.mla_expanded_prefill
    asked = dict(mla_prefill="expanded", linear_attention_prefill="chunked")
    ops = make_rank_ops(EngineConfig(model="demo", **asked), SINGLE, cpu)
    assert ops.gated_delta_rule is gated_delta.gated_delta_rule and ops.mla_expanded_prefill
    for field in asked:
        with pytest.raises(ConfigError, match=f"{field}='blocked' is invalid: expected one of"):
            EngineConfig(model="demo", **{field: "blocked"})


def test_the_logits_take_the_tables_linear_where_deterministic() -> None:
    """The lm_head goes through Ops.linear (batch-invariant) with the mode on; F.linear (cuBLAS
    on the GPU, whose kernel follows how many rows are sampled) otherwise. The table of an
    engine with the flag says so."""
    from types import SimpleNamespace

    from moelora.kernels.ops import REFERENCE_OPS
    from moelora.models.model import MoeCausalLM

    calls = []

    def spy(x, w, bias=None):
        calls.append(x.shape[0])
        return reference.linear(x, w, bias)

    hidden, lm_head = torch.randn(5, 16), torch.randn(40, 16)
    for deterministic in (False, True):
        ops = dataclasses.replace(REFERENCE_OPS, linear=spy, deterministic=deterministic)
        model = SimpleNamespace(ops=ops, lm_head=lm_head, shard=REFERENCE_OPS.shard)
        model.cfg = SimpleNamespace(vocab_size=40)
        got = MoeCausalLM.compute_logits(model, hidden)
        torch.testing.assert_close(got, hidden @ lm_head.T)
    assert calls == [5]
    from moelora.kernels.ops import triton_ops

    flags = [triton_ops("batch-invariant", deterministic=d).deterministic for d in (False, True)]
    assert flags == [False, True]


def test_deterministic_inference_never_folds_the_attention_lora() -> None:
    """A step of up to FOLD_LORA_MAX_TOKENS tokens folds the attention's LoRA into the norms
    (their lane sums), a longer one takes add_lora_ (an MMA chain): a LoRA row's bits would
    follow its step's size. With the mode on every step takes add_lora_ (the GPU's probes in
    batches of 8 to 250 kept their bits only so: tests/gpu/test_determinism_gpu.py)."""
    from types import SimpleNamespace

    from moelora.kernels.ops import REFERENCE_OPS
    from moelora.layers.attention_lora import FOLD_LORA_MAX_TOKENS, folds_lora

    cfg = SimpleNamespace(
        mla=None, attn_output_gate=False, qk_norm="head", clip_qkv=None, head_dim=64
    )
    batch = SimpleNamespace(lora=object())
    for deterministic, folds in ((False, True), (True, False)):
        ops = dataclasses.replace(REFERENCE_OPS, deterministic=deterministic)
        attn = SimpleNamespace(
            cfg=cfg,
            ops=ops,
            qkv_proj=SimpleNamespace(lora=object()),
            o_proj=SimpleNamespace(lora=object()),
        )
        assert folds_lora(attn, batch, 1) is folds
        assert folds_lora(attn, batch, FOLD_LORA_MAX_TOKENS) is folds
        assert not folds_lora(attn, batch, FOLD_LORA_MAX_TOKENS + 1)
