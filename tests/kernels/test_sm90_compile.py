"""Every Triton kernel the engine launches compiles for sm_90 (H100 / H200), checked on the CPU.

The interpreter that runs the kernel tests here does not type-check as the compiler does: a name
bound to two types in an `if`, for one, passes there and fails on the GPU. So the op wrappers run
on CPU tensors with every kernel launch recorded instead of run, at the engine's meta-parameters
(the H200 MoE tile table, the attention configs, LoRA on and off), and each distinct launch is
compiled down to a cubin by Triton and ptxas for sm_90, as the device would. It runs in a
subprocess: the kernels must be decorated without the TRITON_INTERPRET that conftest.py sets.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(Path(__file__).parent)])
    done = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    # every kernel module's kernels were launched at least once and compiled
    assert "kernels: " in done.stdout, done.stdout[-4000:]
    # add_lora_'s A loads are vectorized where its LoraWeights say A is aligned (a_align)
    assert "A hinted: " in done.stdout, done.stdout[-4000:]


# -- the subprocess ------------------------------------------------------------------------------

DTYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.bool: "i1",
    torch.uint8: "u8",
    torch.float8_e4m3fn: "fp8e4nv",
}
OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "launch_pdl", "maxnreg")
SM90_SHARED = 232448  # bytes of shared memory a block may use on sm_90


def record_launches() -> list:
    """kernel[grid](...) records the launch instead of running it (the kernels themselves stay
    as they are: compiling one reads its module's globals)."""
    from triton.runtime.jit import KernelInterface

    launches = []
    KernelInterface.__getitem__ = lambda kernel, grid: (
        lambda *args, **kwargs: launches.append((kernel, args, kwargs))
    )
    return launches


def arg_type(value) -> str:
    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(value, TensorDescriptor):
        return f"tensordesc<{DTYPES[value.base.dtype]}{list(value.block_shape)}>"
    if isinstance(value, torch.Tensor):
        return "*" + DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"unexpected kernel argument {value!r}")


def compile_sm90(kernel, args, kwargs):
    """The launch compiled for sm_90 as the JIT on an H200 would specialize it (also
    bench/sass_moe.py's)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = list(inspect.signature(kernel.fn).parameters)
    # every kernel takes kernels/pdl.py's PDL, off on a CPU: compile what the H200 launches
    assert kwargs.get("PDL") is False, (kernel.fn.__name__, "launched without pdl_kwargs")
    kwargs |= {"PDL": True, "launch_pdl": True}
    options = {k: kwargs.pop(k) for k in OPTIONS if k in kwargs}
    bound = dict(zip(params, args)) | kwargs
    assert set(bound) == set(params), (kernel.fn.__name__, set(params) ^ set(bound))
    constexprs = {p.name for p in kernel.params if p.is_constexpr}  # launches pass all by keyword
    constexprs |= {p for p in params if bound.get(p, 0) is None}  # the JIT's for None
    skip = {p.name for p in kernel.params if p.do_not_specialize}
    # the JIT compiles an integer argument equal to 1 as a constant (unless do_not_specialize):
    # a last-dim stride of 1 lets loads vectorize and pipeline, which takes shared memory
    constexprs |= {p for p in params if p not in skip and type(bound[p]) is int and bound[p] == 1}
    signature = {p: "constexpr" if p in constexprs else arg_type(bound[p]) for p in params}
    # the alignment the JIT would see: 16-byte-aligned pointers, integers divisible by 16
    # (unless do_not_specialize); without it loads are not vectorized or pipelined
    aligned = [
        (i,)
        for i, p in enumerate(params)
        if p not in constexprs
        and p not in skip
        and (
            (isinstance(bound[p], torch.Tensor) and bound[p].data_ptr() % 16 == 0)
            or (type(bound[p]) is int and bound[p] % 16 == 0)
        )
    ]
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(params.index(p),): bound[p] for p in constexprs},
        attrs={key: [["tt.divisibility", 16]] for key in aligned},
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    # the launch would fail with OutOfResources past an H100/H200 block's 227 KiB
    assert compiled.metadata.shared <= SM90_SHARED, (kernel.fn.__name__, options, signature)
    return compiled


def _moe_configs():
    from moelora.kernels.moe.config import MoeConfig

    path = Path(__file__).parents[2] / "moelora/kernels/moe/configs/fused_moe_NVIDIA_H200.json"
    table = json.loads(path.read_text())["E=128,H=2048,I=768,K=8"]
    return [(int(m), MoeConfig(**cfg)) for m, cfg in table.items()]


# A Qwen3-30B-A3B layer: hidden, query and kv heads, head dim; LoRA rank and slots.
BF16 = torch.bfloat16
H, HQ, HKV, D, R, S = 2048, 32, 4, 128, 16, 8


def launch_every_op() -> None:
    """The engine's ops at a Qwen3-30B-A3B layer's sizes (the MoE narrowed in H and I, which
    the kernels take at run time): small batches, one decode and one prefill of each kind."""
    for T in (1, 64, 1024):  # from 1024 tokens the rotary's programs take 8 tokens each
        _launch_norms_and_rotary(T)
    _launch_projections()
    _launch_paged_attention()
    _launch_mla()
    _launch_mla_lora()
    _launch_linear_attention()
    _launch_moe()


def _launch_norms_and_rotary(T: int) -> None:
    """The norms and rotary with and without the attention's folded LoRA, add_lora_, routing."""
    from lora_cases import batch_info, lora_weights

    from moelora.kernels import lora
    from moelora.kernels.attention import norm_rope
    from moelora.kernels.moe import routing
    from moelora.step.lora import FoldedLora

    info = batch_info(T, "mixed")
    qkv = lora_weights(S, (), 3, R, H, (HQ * D, HKV * D, HKV * D), info.rank_of_slot, BF16)
    o = lora_weights(S, (), 1, R, HQ * D, (H,), info.rank_of_slot, BF16)
    x, res, w = torch.randn(T, H, dtype=BF16), torch.randn(T, H, dtype=BF16), torch.ones(H)
    w = w.to(BF16)
    norm_rope.rms_norm(x, w, 1e-6, res)
    norm_rope.rms_norm(x, w, 1e-6, None)
    rows, product = torch.randn(T, 8, H, dtype=BF16), torch.randn(T, 256 + H + 8, dtype=BF16)
    for gate in (None, product[:, 256 + H : 257 + H]):  # the MoE's shared expert joined
        norm_rope.rms_norm(rows, w, 1e-6, res, shared=product[:, 256 : 256 + H], shared_gate=gate)
    _, _, folded = norm_rope.rms_norm_lora(x, w, 1e-6, None, info, shrink=qkv)
    part = lora.lora_shrink_split(torch.randn(T, HQ * D, dtype=BF16), o, info)
    norm_rope.rms_norm_lora(x, w, 1e-6, res, info, expand=FoldedLora(part, o, info))
    lora.add_lora_(torch.randn(T, (HQ + 2 * HKV) * D, dtype=BF16), x, qkv, info)
    y = torch.randn(T, (HQ + 2 * HKV) * D, dtype=BF16)
    q, k, v = y.split([HQ * D, HKV * D, HKV * D], dim=-1)
    q, k, v = q.view(T, HQ, D), k.view(T, HKV, D), v.view(T, HKV, D)
    pos = torch.arange(T)
    cos = sin = torch.randn(4096, D)
    cache = torch.zeros(8, 16, HKV, D, dtype=BF16)
    store = dict(v=v, k_cache=cache, v_cache=cache, slot_mapping=torch.arange(T))
    for norm in (None, torch.ones(D, dtype=BF16)):
        norm_rope.rope_store_kv(q, k, pos, cos, sin, norm, norm, 1e-6)
        norm_rope.rope_store_kv(q, k, pos, cos, sin, norm, norm, 1e-6, **store, rotary_dim=64)
        norm_rope.rope_store_kv(q, k, pos, cos, sin, norm, norm, 1e-6, **store)
        norm_rope.rope_store_kv(q, k, pos, cos, sin, norm, norm, 1e-6, **store, expand=folded)
        partial = dict(expand=folded, rotary_dim=64)  # GLM-4.5's folded LoRA
        norm_rope.rope_store_kv(q, k, pos, cos, sin, norm, norm, 1e-6, **store, **partial)
    for scoring in ("softmax", "sigmoid"):
        routing.route_topk(torch.randn(T, 128), 8, scoring=scoring, renormalize=True)
    _launch_grouped_routing(T)
    _launch_mlp(T)


def _launch_mlp(T: int) -> None:
    """A shared expert's and a dense layer's SwiGLU (with its LoRA folded too), and the join of
    the routed experts' top-k rows (or their sum) with the shared expert, gated and not; the
    attention's output gate."""
    from lora_cases import batch_info, lora_weights

    from moelora.kernels import mlp, reference
    from moelora.step.lora import FoldedLora

    info = batch_info(T, "mixed")
    for I in (1408, 11264):
        gate_up = torch.randn(T, 2 * I, dtype=BF16)
        mlp.silu_and_mul(gate_up)
        # with the LoRA folded (layers/mlp_lora.py): each half alone, and both
        up_lora = lora_weights(S, (), 2, R, H, (I, I), info.rank_of_slot, BF16)
        down_lora = lora_weights(S, (), 1, R, I, (H,), info.rank_of_slot, BF16)
        x = torch.randn(T, H, dtype=BF16)
        folded = FoldedLora(reference.lora_shrink(x, up_lora, info), up_lora, info)
        for expand, shrink in ((folded, None), (None, down_lora), (folded, down_lora)):
            mlp.silu_and_mul_lora(gate_up, info, expand=expand, shrink=shrink)
    from moelora.kernels.attention.output_gate import output_gate

    q_gate = torch.randn(T, HQ, 2, D, dtype=BF16)
    output_gate(torch.randn(T, HQ, D, dtype=BF16), q_gate[:, :, 1])
    for rows in (torch.randn(T, 8, H, dtype=BF16), torch.randn(T, H, dtype=BF16)):
        for gate in (None, torch.randn(T, 1, dtype=BF16)):
            mlp.add_shared_expert(rows, torch.randn(T, H, dtype=BF16), gate)


def _launch_grouped_routing(T: int) -> None:
    """DeepSeek-V3's (256 experts, 8 groups, 4 allowed), Moonlight's and GLM-4.5's (one
    group), DeepSeek-V2's (160 experts, 8 groups of 20, 3 allowed)."""
    from moelora.config import GroupedRouting
    from moelora.kernels.moe import routing

    for E, K, n_group, topk_group, bias in (
        (256, 8, 8, 4, True),
        (64, 6, 1, 1, True),
        (160, 8, 1, 1, True),
        (160, 6, 8, 3, False),
    ):
        grouped = GroupedRouting(
            n_group=n_group,
            topk_group=topk_group,
            group_score="top2_sum" if bias else "max",
            routed_scaling_factor=2.5,
            correction_bias=bias,
        )
        routing.route_topk(
            torch.randn(T, E, dtype=BF16),
            K,
            scoring="sigmoid" if bias else "softmax",
            renormalize=bias,
            grouped=grouped,
            correction_bias=torch.randn(E) if bias else None,
        )


def _launch_projections() -> None:
    """The skinny projections of one- to eight-token steps (q|k|v, o, router, with a bias),
    and the batch-invariant ones at every config bucket (the real K: the pipeline depth and
    shared memory depend on it), with and without a bias, and on block-FP8 weights."""
    from moelora.kernels import linear, linear_fp8
    from moelora.kernels.fp8_block import quantize_fp8_block

    for M in (1, 2, 4, 8):
        for N, K in ((HQ * D + 2 * HKV * D, H), (H, HQ * D), (128, H)):
            linear.skinny_linear(torch.randn(M, K, dtype=BF16), torch.randn(N, K, dtype=BF16))
    x = torch.randn(1, H, dtype=BF16)
    linear.skinny_linear(x, torch.randn(64, H, dtype=BF16), torch.randn(64, dtype=BF16))
    for M in (1, 2, 4, 13, 24, 64, 100):
        for N, K in ((5120, 2048), (2048, 4096), (128, 2048)):
            w = torch.randn(N, K, dtype=BF16)
            linear.dot_linear(torch.randn(M, K, dtype=BF16), w, torch.randn(N, dtype=BF16))
            linear.dot_linear(torch.randn(M, K, dtype=BF16), w)
    for M in (1, 64):  # block-FP8 q|k|v and o at fp8_dot_config's tiles (64 rows, 4+ warps)
        for N, K in ((5120, 2048), (2048, 4096)):
            codes, scale_inv = quantize_fp8_block(torch.randn(N, K))
            linear_fp8.fp8_linear(torch.randn(M, K, dtype=BF16), codes, scale_inv)
    linear_fp8.dequantize_fp8(codes, scale_inv, BF16)  # a prefill's whole weight


def _launch_paged_attention() -> None:
    """Decode without and with splits (with the o LoRA's shrink too), and a prefill."""
    from lora_cases import batch_info, lora_weights

    from moelora.kernels.attention import paged as paged_attention
    from moelora.step.batch import AttentionMetadata

    pages = torch.arange(8, dtype=torch.int32).view(2, 4)
    seq_lens = torch.tensor([40, 64], dtype=torch.int32)
    decode = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=seq_lens,
        page_table=pages,
        slot_mapping=torch.tensor([39, 63]),
        max_query_len=1,
    )
    prefill = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, 40, 64], dtype=torch.int32),
        seq_lens=seq_lens,
        page_table=pages,
        slot_mapping=torch.arange(64),
        max_query_len=40,
    )
    cache = torch.zeros(8, 16, HKV, D, dtype=BF16)
    run = paged_attention.launch_paged_attention
    q = torch.randn(2, HQ, D, dtype=BF16)
    run(q, cache, cache, decode, 0.1, config=paged_attention.DECODE_CONFIG, num_splits=1)
    run(q, cache, cache, decode, 0.1, config=paged_attention.DECODE_SPLIT_CONFIG, num_splits=4)
    info = batch_info(2, "mixed")
    o = lora_weights(S, (), 1, R, HQ * D, (H,), info.rank_of_slot, BF16)
    split = dict(config=paged_attention.DECODE_SPLIT_CONFIG, num_splits=4, shrink=o, info=info)
    run(q, cache, cache, decode, 0.1, **split)
    oss = dict(window=16, sinks=torch.randn(HQ))  # GPT-OSS's sliding layers
    run(
        q,
        cache,
        cache,
        decode,
        0.1,
        config=paged_attention.DECODE_SPLIT_CONFIG,
        num_splits=4,
        **oss,
    )
    q = torch.randn(64, HQ, D, dtype=BF16)
    run(q, cache, cache, prefill, 0.1, config=paged_attention.PREFILL_CONFIG)
    run(q, cache, cache, prefill, 0.1, config=paged_attention.PREFILL_CONFIG, **oss)
    # Qwen3.5's gated attention: 16 q heads, 2 KV heads of 256, the tiles fitted to the head
    cache, fit = torch.zeros(8, 16, 2, 256, dtype=BF16), paged_attention.fit_head_dim
    for config, num_splits in (
        (paged_attention.DECODE_CONFIG, 1),
        (paged_attention.DECODE_SPLIT_CONFIG, 4),
    ):
        q = torch.randn(2, 16, 256, dtype=BF16)
        run(q, cache, cache, decode, 0.1, config=fit(config, 256), num_splits=num_splits)
    q = torch.randn(64, 16, 256, dtype=BF16)
    run(q, cache, cache, prefill, 0.1, config=fit(paged_attention.PREFILL_CONFIG, 256))


def _launch_mla_rotary(latent: torch.Tensor, rope: torch.Tensor) -> None:
    """The rotary of q_pe and k_pe (DeepSeek's adjacent pairs) with the latent's store, its norm
    inside (v_norm) or not."""
    from moelora.kernels.attention import norm_rope

    Hh, N, Rr, L = 16, 128, 64, 512  # _launch_mla's
    cos = sin = torch.randn(4096, Rr)
    for T in (1, 4096):
        q = torch.randn(T, Hh, N + Rr, dtype=BF16)[..., N:]
        k_pe = torch.randn(T, L + Rr, dtype=BF16)[:, L:].view(T, 1, Rr)
        stores = dict(
            v=torch.randn(T, 1, L, dtype=BF16),
            k_cache=rope,
            v_cache=latent,
            slot_mapping=torch.zeros(T, dtype=torch.int64),
        )
        for v_norm in (None, torch.ones(L, dtype=BF16)):
            rotary = dict(interleaved=True, v_norm=v_norm)
            norm_rope.rope_store_kv(
                q, k_pe, torch.arange(T), cos, sin, None, None, 1e-6, **stores, **rotary
            )


def _launch_mla() -> None:
    """MLA at DeepSeek-V3's sizes (a rank's 16 heads, N = V = 128, R = 64, L = 512): the latent
    form's decode (split and not) and prefill (its first chunks skipped or not), and the
    expanded form of a prefill step, the absorption of kv_b_proj around the latent form and the
    rotary of DeepSeek's adjacent pairs."""
    from moelora.kernels.attention import mla, mla_absorb, mla_expanded
    from moelora.kernels.mla import ExpandedKv
    from moelora.step.batch import AttentionMetadata

    Hh, N, V, Rr, L = 16, 128, 128, 64, 512
    cache = torch.zeros(8, 16, 1, L + Rr, dtype=BF16)
    latent, rope = cache[..., :L], cache[..., L:]

    def metadata(q_lens: list[int]) -> AttentionMetadata:
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        table = torch.zeros(len(q_lens), 8, dtype=torch.int32)
        slots = torch.zeros(int(cu[-1]), dtype=torch.int64)
        return AttentionMetadata(cu, cu[1:] + 3, table, slots, max(q_lens))

    decode, prefill = metadata([1, 1]), metadata([64, 33])
    q_lat, q_pe = torch.randn(2, Hh, L), torch.randn(2, Hh, Rr)
    for num_splits in (1, 4):
        config = mla.DECODE_CONFIG
        mla.latent_attention(
            q_lat, q_pe, latent, rope, decode, 0.1, config=config, num_splits=num_splits
        )
    q_lat, q_pe = torch.randn(97, Hh, L), torch.randn(97, Hh, Rr)
    for skip in (None, prefill.cu_seqlens_q):
        mla.latent_attention(
            q_lat, q_pe, latent, rope, prefill, 0.1, skip_expanded=skip, config=mla.PREFILL_CONFIG
        )
    q = torch.randn(97, Hh, N + Rr, dtype=BF16)
    kv = torch.randn(97, Hh, N + V, dtype=BF16)
    k_pe = torch.randn(97, Rr, dtype=BF16)
    expanded = ExpandedKv(kv[..., :N], k_pe, kv[..., N:], prefill.cu_seqlens_q)
    out = torch.empty(97, Hh, V, dtype=BF16)
    q_nope, q_pe = q[..., :N], q[..., N:]
    config = mla_expanded.CONFIG
    mla_expanded.expanded_attention_(out, q_nope, q_pe, expanded, prefill, 0.1, config=config)
    _launch_mla_rotary(latent, rope)
    kv_b = torch.randn(Hh * (N + V), L, dtype=BF16)
    for T in (1, 64, 4096):  # the absorption's token tiles, 16 to 64 rows
        mla_absorb.absorb_q(torch.randn(T, Hh, N + Rr, dtype=BF16)[..., :N], kv_b)
        for out_dtype in (torch.float32, BF16):  # before kv_b's LoRA, or rounded at once
            mla_absorb.absorb_out(torch.randn(T, Hh, L), kv_b, N, out_dtype)
    # a prefill step's absorption skipping the blocks of sequences that attend expanded
    skip = mla_absorb.SkipExpanded(prefill.cu_seqlens_q, prefill.seq_lens, prefill.cu_seqlens_q)
    mla_absorb.absorb_q(q_nope, kv_b, skip=skip)
    mla_absorb.absorb_out(torch.randn(97, Hh, L), kv_b, N, BF16, skip=skip)


def _launch_linear_attention() -> None:
    """Gated DeltaNet at Qwen3.5-MoE's sizes (16 q/k heads, 32 value heads, K = V = 128, a
    4-tap conv over 8192 channels): the conv, the delta rule's gates, its token loop and its
    block form, the gated norm, at decode and prefill."""
    from lora_cases import batch_info, lora_weights

    from moelora.kernels.gated_delta import DeltaGates
    from moelora.kernels.linear_attention import (
        conv,
        delta_chunked,
        delta_rule,
        gated_norm,
        gates,
    )
    from moelora.step.batch import AttentionMetadata

    Hk, Hv, Kd, Vd, Cc, W = 16, 32, 128, 128, 8192, 4
    state = torch.zeros(9, Hv, Kd, Vd)
    conv_state = torch.zeros(9, Cc, W - 1, dtype=BF16)
    for q_lens in ([1, 1], [300, 33]):
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        T = int(cu[-1])
        attn = AttentionMetadata(
            cu,
            cu[1:] + 3,
            torch.zeros(2, 1, dtype=torch.int32),
            torch.zeros(T, dtype=torch.int64),
            max(q_lens),
            state_slots=torch.tensor([1, 2], dtype=torch.int32),
        )
        conv.causal_conv1d(
            torch.randn(T, Cc, dtype=BF16), torch.randn(Cc, W, dtype=BF16), conv_state, attn
        )
        qkv = torch.randn(T, 2 * Hk * Kd + Hv * Vd, dtype=BF16)
        q, k, v = qkv.split([Hk * Kd, Hk * Kd, Hv * Vd], dim=-1)
        args = (q.view(T, Hk, Kd), k.view(T, Hk, Kd), v.view(T, Hv, Vd))
        g, beta = torch.rand(T, Hv), torch.rand(T, Hv, dtype=BF16)
        delta_rule.gated_delta_rule(*args, g, beta, state, attn)
        if T > 2:
            config = delta_chunked.CONFIG
            delta_chunked.chunked_gated_delta_rule(*args, g, beta, state, attn, config=config)
        x = torch.randn(T * Hv, Vd, dtype=BF16)
        gated_norm.rms_norm_gated(
            x, torch.randn(T * Hv, Vd, dtype=BF16), torch.randn(Vd, dtype=BF16), 1e-6
        )
        z = torch.randn(T, 2 * Hv * Vd, dtype=BF16)[:, Hv * Vd :].view(T, Hv, Vd)
        gated_norm.rms_norm_gated(x.view(T, Hv, Vd), z, torch.randn(Vd, dtype=BF16), 1e-6)
        info = batch_info(T, "mixed")  # with out_proj's LoRA shrink
        out_lora = lora_weights(S, (), 1, R, Hv * Vd, (H,), info.rank_of_slot, BF16)
        norm_w = torch.randn(Vd, dtype=BF16)
        gated_norm.rms_norm_gated_o_shrink(x.view(T, Hv, Vd), z, norm_w, 1e-6, out_lora, info)
        ba = torch.randn(T, 2 * Hv, dtype=BF16)
        gates.delta_gates(ba[:, Hv:], ba[:, :Hv], torch.randn(Hv), torch.randn(Hv, dtype=BF16))
        raw = DeltaGates(ba[:, Hv:], ba[:, :Hv], torch.randn(Hv, dtype=BF16), ba[0, :Hv])
        delta_rule.gated_delta_rule(*args, None, None, state, attn, gates=raw)  # g, beta inside


def _launch_mla_lora() -> None:
    """The absorption with kv_b_proj's LoRA inside, both sides, and o_proj's LoRA shrink in
    the out side, at DeepSeek-V3's sizes (a rank's 16 heads, N = V = 128, L = 512), at its
    token tiles."""
    from lora_cases import batch_info, lora_weights

    from moelora.kernels.attention import mla_absorb

    Hh, N, V, L = 16, 128, 128, 512
    kv_b = torch.randn(Hh * (N + V), L, dtype=BF16)
    for T in (1, 64, 4096):
        info = batch_info(T, "mixed")
        lora = lora_weights(S, (), 1, R, L, (Hh * (N + V),), info.rank_of_slot, BF16)
        q_nope = torch.randn(T, Hh, N + 64, dtype=BF16)[..., :N]
        mla_absorb.absorb_q(q_nope, kv_b, lora=lora, info=info)
        for out_dtype in (torch.float32, BF16):
            mla_absorb.absorb_out(torch.randn(T, Hh, L), kv_b, N, out_dtype, lora=lora, info=info)
        o_lora = lora_weights(S, (), 1, R, Hh * V, (H,), info.rank_of_slot, BF16)
        for kv_b_lora in (lora, None):  # o_proj's shrink beside kv_b_proj's LoRA, or alone
            o_lat = torch.randn(T, Hh, L)
            mla_absorb.absorb_out_o_shrink(
                o_lat, kv_b, N, BF16, lora=kv_b_lora, info=info, o_lora=o_lora
            )
    # the first LoRA pass's other schedule: its own walk, G the pool's (G_BY_ROWS off)
    saved = mla_absorb.FUSED_SIDES, mla_absorb.G_BY_ROWS
    mla_absorb.FUSED_SIDES, mla_absorb.G_BY_ROWS = (), False
    try:
        for T in (1, 64):
            info = batch_info(T, "mixed")
            lora = lora_weights(S, (), 1, R, L, (Hh * (N + V),), info.rank_of_slot, BF16)
            q_nope = torch.randn(T, Hh, N + 64, dtype=BF16)[..., :N]
            mla_absorb.absorb_q(q_nope, kv_b, lora=lora, info=info)
            o_lora = lora_weights(S, (), 1, R, Hh * V, (H,), info.rank_of_slot, BF16)
            o_lat = torch.randn(T, Hh, L)
            mla_absorb.absorb_out_o_shrink(
                o_lat, kv_b, N, BF16, lora=lora, info=info, o_lora=o_lora
            )
    finally:
        mla_absorb.FUSED_SIDES, mla_absorb.G_BY_ROWS = saved


def _launch_moe() -> None:
    """The MoE at every tuned tile config, LoRA off and on; past PMAX pairs the align's two
    launches at each chunk size (CHUNK_MIN..CHUNK_MAX), LoRA off and on."""
    from lora_cases import batch_info, lora_weights

    from moelora.kernels.moe import align as moe_align
    from moelora.kernels.moe.fused import fused_moe

    E, Hm, Im, K = 128, 256, 128, 8
    w13 = torch.randn(E, 2 * Im, Hm, dtype=BF16)
    w2 = torch.randn(E, Hm, Im, dtype=BF16)
    for T, config in _moe_configs():
        info = batch_info(T, "mixed")
        l13 = lora_weights(S, (E,), 2, R, Hm, (Im, Im), info.rank_of_slot, BF16)
        l2 = lora_weights(S, (E,), 1, R, Im, (Hm,), info.rank_of_slot, BF16)
        x = torch.randn(T, Hm, dtype=BF16)
        weights, ids = torch.rand(T, K), torch.randint(0, E, (T, K), dtype=torch.int32)
        fused_moe(x, w13, w2, weights, ids, config=config)
        fused_moe(x, w13, w2, weights, ids, lora13=l13, lora2=l2, info=info, config=config)
    for T, BM in ((600, 64), (4096, 16), (8192, 128), (16384, 32)):  # chunks of 256, 512, 1024
        moe_align.moe_align(torch.randint(0, E, (T, K), dtype=torch.int32), E, BM)
    T, config = 1024, max(_moe_configs(), key=lambda tc: tc[0])[1]  # the largest bucket's
    info = batch_info(T, "mixed")
    l13 = lora_weights(S, (E,), 2, R, Hm, (Im, Im), info.rank_of_slot, BF16)
    l2 = lora_weights(S, (E,), 1, R, Im, (Hm,), info.rank_of_slot, BF16)
    x, weights = torch.randn(T, Hm, dtype=BF16), torch.rand(T, K)
    ids = torch.randint(0, E, (T, K), dtype=torch.int32)
    fused_moe(x, w13, w2, weights, ids, lora13=l13, lora2=l2, info=info, config=config)
    _launch_mxfp4_moe()
    _launch_fp8_moe()


def _launch_mxfp4_moe() -> None:
    """GPT-OSS's packed experts at its tuned tiles, LoRA on, biases and the clamped SwiGLU.
    On CPU tensors the launch takes the arithmetic expansion; main() compiles the bit
    placement's variants (either layout) of each MXFP4 launch as well, and the table lookups'
    of one."""
    from lora_cases import batch_info, lora_weights, mxfp4_weight

    from moelora.kernels.moe.config import MoeConfig
    from moelora.kernels.moe.fused import fused_moe

    path = Path(__file__).parents[2] / "moelora/kernels/moe/configs/fused_moe_NVIDIA_H200.json"
    table = json.loads(path.read_text())["E=128,H=2880,I=2880,K=4,mxfp4"]
    E, Hm, Im, K = 32, 256, 128, 4
    w13, w2 = mxfp4_weight(E, 2 * Im, Hm, (118, 122)), mxfp4_weight(E, Hm, Im, (118, 122))
    oss = dict(
        b13=torch.randn(E, 2 * Im, dtype=BF16),
        b2=torch.randn(E, Hm, dtype=BF16),
        activation="swiglu_oai",
    )
    for T, cfg in ((int(m), MoeConfig(**c)) for m, c in table.items()):
        info = batch_info(T, "mixed")
        l13 = lora_weights(S, (E,), 2, R, Hm, (Im, Im), info.rank_of_slot, BF16)
        l2 = lora_weights(S, (E,), 1, R, Im, (Hm,), info.rank_of_slot, BF16)
        x, weights = torch.randn(T, Hm, dtype=BF16), torch.rand(T, K)
        ids = torch.randint(0, E, (T, K), dtype=torch.int32)
        lora = dict(lora13=l13, lora2=l2, info=info)
        fused_moe(x, w13, w2, weights, ids, **lora, config=cfg, **oss)


def _launch_fp8_moe() -> None:
    """Block-FP8 experts (no tuned table yet) at the bf16 table's tiles that fit them (BK
    dividing 128; their TMA flags take the code tiles through descriptors), at the default
    tiles and the deterministic ones, and W8A8 at six tiles, LoRA off and on."""
    from lora_cases import batch_info, fp8_weight, lora_weights

    from moelora.kernels.moe.config import MoeConfig
    from moelora.kernels.moe.fp8 import fp8_tiles_fit
    from moelora.kernels.moe.fused import fused_moe

    E, Hm, Im, K = 128, 256, 128, 8
    w13, w2 = fp8_weight(E, 2 * Im, Hm, 2), fp8_weight(E, Hm, Im, 2)
    fits = [
        (T, cfg)
        for T, cfg in _moe_configs()
        if fp8_tiles_fit(cfg.block_k) and fp8_tiles_fit(cfg.block_k_down)
    ]
    cases = [(T, cfg, False) for T, cfg in fits] + [(1, None, False), (64, None, True)]
    # W8A8's tiles, h in groups of 128 or (128 rows) 64, some with the weights' code tiles
    # through TMA
    for bm, bn, bnd, warps, tma in (
        (16, 128, 64, 4, 0),
        (64, 128, 64, 8, 0),
        (64, 128, 128, 8, 0),
        (64, 128, 128, 8, 1),
        (128, 64, 128, 8, 1),
        (128, 64, 64, 8, 0),
    ):
        tiles = dict(block_n=bn, block_k=128, block_n_down=bnd, block_k_down=bn, tma=bool(tma))
        cases.append((256, MoeConfig(block_m=bm, **tiles, num_warps=warps, w8a8=True), False))
    for T, config, deterministic in cases:
        info = batch_info(T, "mixed")
        l13 = lora_weights(S, (E,), 2, R, Hm, (Im, Im), info.rank_of_slot, BF16)
        l2 = lora_weights(S, (E,), 1, R, Im, (Hm,), info.rank_of_slot, BF16)
        x, weights = torch.randn(T, Hm, dtype=BF16), torch.rand(T, K)
        ids = torch.randint(0, E, (T, K), dtype=torch.int32)
        lora = dict(lora13=l13, lora2=l2, info=info)
        for with_lora in ({}, lora):
            fused_moe(
                x, w13, w2, weights, ids, **with_lora, config=config, deterministic=deterministic
            )


def main() -> None:
    launches = record_launches()
    launch_every_op()
    seen, names, looked_up = set(), set(), set()
    for kernel, args, kwargs in launches:
        key = (kernel.fn.__name__, repr([arg_type(a) for a in args]), repr(sorted(kwargs.items())))
        if key not in seen:
            seen.add(key)
            names.add(kernel.fn.__name__)
            compile_sm90(kernel, args, dict(kwargs))
            if kwargs.get("MXFP4"):  # what a CUDA bf16 launch takes (fused_moe._experts)
                # bit placement from either layout at every tile; the table lookups (scales
                # past 128) at one: the expansion changes registers, not the tiles' shared memory
                compile_sm90(kernel, args, dict(kwargs, MXFP4_EXPAND=2))
                compile_sm90(kernel, args, dict(kwargs, MXFP4_EXPAND=3))
                compile_sm90(kernel, args, dict(kwargs, MXFP4_EXPAND=3, MXFP4_SUB_K=64))
                if kernel.fn.__name__ not in looked_up:
                    looked_up.add(kernel.fn.__name__)
                    compile_sm90(kernel, args, dict(kwargs, MXFP4_EXPAND=1))
            # block-FP8 weight-only: the code tiles by bit placement (a CUDA bf16 launch's
            # with fused.FP8_PLACED), once a kernel, pointers and TMA
            placed = (kernel.fn.__name__, kwargs.get("TMA"))
            moe_fp8 = "FP8_PLACED" in kwargs and kwargs["FP8"] and not kwargs.get("W8A8")
            if moe_fp8 and placed not in looked_up:
                looked_up.add(placed)
                compile_sm90(kernel, args, dict(kwargs, FP8_PLACED=True))
    print(f"compiled {len(seen)} launches; kernels: {sorted(names)}")
    print(check_a_alignment_hint(launches))


def one_element_loads(ptx: str) -> tuple[int, int]:
    """(16-bit global loads of one element, copies into shared memory) in a kernel's PTX."""
    scalar = re.findall(r"ld\.global(?:\.[a-z]+)*\.[bu]16\b", ptx)
    return len(scalar), len(re.findall(r"cp\.async\.c[ag]", ptx))


def check_a_alignment_hint(launches: list) -> str:
    """add_lora_'s one-token launch, compiled with LoraWeights.a_align (8 here) and without it
    (1): A's offsets come from the table, so only the hint lets its tiles load 16 bytes at a
    time into shared memory; without it each is loaded an element at a time."""
    kernel, args, kwargs = next(
        (k, a, kw)
        for k, a, kw in launches
        if k.fn.__name__ == "_add_lora_kernel" and kw["T"] == 1 and kw["A_ALIGN"] == 8
    )
    hinted = one_element_loads(compile_sm90(kernel, args, dict(kwargs)).asm["ptx"])
    plain = one_element_loads(compile_sm90(kernel, args, dict(kwargs, A_ALIGN=1)).asm["ptx"])
    assert hinted[0] < plain[0] and hinted[1] > plain[1], (hinted, plain)
    return f"A hinted: {hinted} (one-element loads, copies), not hinted: {plain}"


if __name__ == "__main__":
    main()
