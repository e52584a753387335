"""The libraries made for two of our prefill kernels, timed beside them in one run (DESIGN.md:
look at them and measure before writing a kernel).

    PYTHONPATH=.:bench python bench/library_check.py grouped-mm [--shapes ...] [--ms 1024 4096]
    PYTHONPATH=.:bench python bench/library_check.py fla [--tokens 4096 16384]
    PYTHONPATH=.:bench python bench/library_check.py scaled-mm [--ms 1024 4096 16384]

grouped-mm: torch._grouped_mm (CUTLASS's grouped GEMM, bf16, Hopper) against fused_moe's base
(no LoRA pools; and with pools whose slots are all off, as a base-only prefill step runs) at
prefill sizes. "grouped_mm 2 gemms" is the two grouped GEMMs alone on rows already sorted by
expert: what a MoE built on it could reach at best; "grouped_mm moe" adds torch's sort, gather,
SiLU-and-mul and weighted scatter around them. The floor: the routed pairs' FLOPs over an
8192^3 torch.mm's throughput, measured in the same run. CUDA-graph replays, L2 flushed.

fla: fla-core's chunk_gated_delta_rule (flash-linear-attention, installed beside; not a
dependency of moelora) against kernels/linear_attention/delta_chunked on one fresh sequence at
Qwen3.5's heads (16 q/k heads repeated to fla's 32, outside the timing), do_bench medians; the
outputs' and final states' relative differences beside.

scaled-mm: torch.nn.functional.scaled_mm with DeepSeek's block scales (activations 1 x 128,
weights 128 x 128: cuBLASLt's FP8 GEMM, Hopper only) on Qwen3-30B-A3B's dense projections,
against the bf16 torch.mm the engine runs there today: what FP8 projections (issue 43) would
take at prefill sizes, with and without the activations' quantization (fp8.quantize_rows_fp8,
ours). The relative difference is against float32 products of the same codes and scales. The
floors: the FLOPs over the run's 8192^3 bf16 torch.mm, and half of it for FP8.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import (
    DEV,
    DT,
    MOE_SHAPES,
    batch_info,
    graph_ms,
    lora_pool,
    matmul_flops_per_s,
    result_header,
    write_result,
)

from moelora.kernels import reference
from moelora.kernels.moe.config import default_config
from moelora.kernels.moe.fused import fused_moe
from moelora.step.batch import AttentionMetadata

GMM_SHAPES = ("qwen3-30b-a3b", "qwen3.5-moe-35b-a3b", "moonlight-16b-a3b")
LAYERS = 2  # a graph replays this many layers of distinct experts


def expert_offsets(ids: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [T K] of the pairs sorted by expert, offs [E] int32 each group's end): no host
    read (torch.bincount would sync), so it captures."""
    flat = ids.flatten().long()
    ones = torch.ones_like(flat, dtype=torch.int32)
    counts = torch.zeros(E, dtype=torch.int32, device=ids.device).scatter_add_(0, flat, ones)
    return torch.argsort(flat, stable=True), counts.cumsum(0, dtype=torch.int32)


def grouped_mm_moe(x, w13t, w2t, weights, ids) -> torch.Tensor:
    """fused_moe's base semantics on torch._grouped_mm: w13t [E, H, 2I] and w2t [E, I, H], the
    experts' weights transposed (views: column-major, as the CUTLASS kernel takes them)."""
    (T, K), I = ids.shape, w2t.shape[1]
    order, offs = expert_offsets(ids, w13t.shape[0])
    g = torch._grouped_mm(x.index_select(0, order // K), w13t, offs=offs)
    d = torch._grouped_mm(F.silu(g[:, :I]) * g[:, I:], w2t, offs=offs)
    d = d * weights.flatten()[order, None].to(d.dtype)
    out = torch.empty_like(d)
    out[order] = d
    return out.view(T, K, -1).sum(1)


def grouped_mm_case(name: str, M: int, flops_s: float) -> list[str]:
    """One shape at M tokens: its lines, each variant's µs per layer beside the floor."""
    E, H, I, K, _ = MOE_SHAPES[name]
    w13 = [torch.randn(E, 2 * I, H, dtype=DT, device=DEV) * H**-0.5 for _ in range(LAYERS)]
    w2 = [torch.randn(E, H, I, dtype=DT, device=DEV) * I**-0.5 for _ in range(LAYERS)]
    pools = [lora_pool(E, H, I, 16, 16) for _ in range(LAYERS)]
    x = torch.randn(M, H, dtype=DT, device=DEV)
    tw, ti = reference.route_topk(torch.randn(M, E, device=DEV), K, renormalize=True)
    cfg, info = default_config(M, E, H, I, K, torch.device(DEV)), batch_info(M, "none", 16)
    w13t, w2t = [w.transpose(1, 2) for w in w13], [w.transpose(1, 2) for w in w2]
    want = fused_moe(x, w13[0], w2[0], tw, ti, config=cfg).float()
    err = (grouped_mm_moe(x, w13t[0], w2t[0], tw, ti).float() - want).norm() / want.norm()
    order, offs = expert_offsets(ti, E)
    rows, h = x.index_select(0, order // K), torch.randn(M * K, I, dtype=DT, device=DEV)
    runs = {
        "fused_moe base": lambda i: fused_moe(x, w13[i], w2[i], tw, ti, config=cfg),
        "fused_moe, pools off": lambda i: fused_moe(
            x, w13[i], w2[i], tw, ti, lora13=pools[i][0], lora2=pools[i][1], info=info, config=cfg
        ),
        "grouped_mm moe": lambda i: grouped_mm_moe(x, w13t[i], w2t[i], tw, ti),
        "grouped_mm 2 gemms": lambda i: (
            torch._grouped_mm(rows, w13t[i], offs=offs),
            torch._grouped_mm(h, w2t[i], offs=offs),
        ),
    }
    floor = 1e6 * 2 * M * K * 3 * H * I / flops_s
    lines = []
    for label, run in runs.items():
        us = 1e3 * graph_ms(lambda run=run: [run(i) for i in range(LAYERS)], LAYERS)
        lines.append(f"| {name} | {M} | {label} | {us:.1f} | {floor:.1f} | {us / floor:.2f} |")
        print(lines[-1], flush=True)
    return lines + [f"| {name} | {M} | grouped_mm moe vs fused_moe: rel. diff {err:.1e} | | | |"]


def grouped_mm_check(args: argparse.Namespace) -> list[str]:
    flops_s = matmul_flops_per_s(DEV)
    lines = [
        f"- matmul throughput (8192^3 bf16 torch.mm): {flops_s / 1e12:.0f} TFLOP/s",
        f"- fused_moe at the tile table's tiles (default_config); {LAYERS} layers a graph",
        "",
        "| shape | tokens | what | µs a layer | FLOP floor µs | x floor |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for name in args.shapes:
        for M in args.ms:
            torch.manual_seed(0)
            lines += grouped_mm_case(name, M, flops_s)
    return lines


def one_sequence(T: int) -> AttentionMetadata:
    """A fresh sequence of T tokens in state slot 0."""
    i32 = dict(dtype=torch.int32, device=DEV)
    return AttentionMetadata(
        torch.tensor([0, T], **i32),
        torch.tensor([T], **i32),
        torch.zeros(1, 1, **i32),
        torch.zeros(T, dtype=torch.int64, device=DEV),
        T,
        state_slots=torch.tensor([0], **i32),
    )


def fla_case(T: int) -> str:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from triton.testing import do_bench

    from moelora.kernels.linear_attention.delta_chunked import chunked_gated_delta_rule

    Hk, H, K, V = 16, 32, 128, 128  # Qwen3.5's / Qwen3-Next's gated DeltaNet heads
    q, k = (torch.randn(T, Hk, K, dtype=DT, device=DEV) for _ in range(2))
    v = torch.randn(T, H, V, dtype=DT, device=DEV)
    g = -torch.rand(T, H, device=DEV) * 0.1 - 0.01  # log decays
    beta, state = torch.rand(T, H, device=DEV), torch.zeros(2, H, K, V, device=DEV)
    attn = one_sequence(T)
    qf, kf = (t.repeat_interleave(H // Hk, 1)[None].contiguous() for t in (q, k))

    def ours():
        return chunked_gated_delta_rule(q, k, v, g, beta, state, attn)

    def theirs():
        return chunk_gated_delta_rule(
            qf,
            kf,
            v[None],
            g[None],
            beta[None],
            scale=K**-0.5,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # as ours: q and k l2-normed in the kernel, q scaled by K^-0.5

    got, (want, final) = ours(), theirs()
    err = ((got.float() - want[0].float()).norm() / want.float().norm()).item()
    state_err = ((state[0] - final[0].float()).norm() / final.float().norm()).item()
    us_ours = 1e3 * do_bench(ours, return_mode="median")
    us_fla = 1e3 * do_bench(theirs, return_mode="median")
    line = f"| {T} | {us_ours:.1f} | {us_fla:.1f} | {us_ours / us_fla:.2f} | {err:.1e} | "
    return line + f"{state_err:.1e} |"


def fla_check(args: argparse.Namespace) -> list[str]:
    import fla

    lines = [
        f"- fla-core {fla.__version__}; one fresh sequence, 16 q/k heads, 32 value heads, 128",
        "",
        "| tokens | ours µs | fla µs | ours / fla | output rel. diff | state rel. diff |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for T in args.tokens:
        torch.manual_seed(0)
        lines.append(fla_case(T))
        print(lines[-1], flush=True)
    return lines


# Qwen3-30B-A3B's dense projections, (N, K): q, k and v fused (32 query and 4 KV heads of
# 128), and o
PROJECTIONS = {"qkv": (5120, 2048), "o": (2048, 4096)}


def _block_scaled_mm(xq, xs, wq, ws_op):
    """F.scaled_mm's block-scaled form: xq [M, K] codes and xs [M, K / 128] scales (1 x 128),
    wq [N, K] codes and ws_op its [N / 128, K / 128] scales padded and transposed as cuBLASLt
    takes them (scaled_mm_weight_scales)."""
    recipe = F.ScalingType
    xs_cols = xs.t().contiguous().t()  # column-major, as the 1 x 128 recipe takes them
    return F.scaled_mm(
        xq,
        wq.t(),
        xs_cols,
        recipe.BlockWise1x128,
        ws_op,
        recipe.BlockWise128x128,
        output_dtype=DT,
    )


def scaled_mm_weight_scales(scale_inv: torch.Tensor) -> torch.Tensor:
    """[N / 128, K / 128] -> cuBLASLt's 128 x 128 layout: the K blocks padded to a multiple of
    4 with zeros, then the transposed view [pad4(K / 128), N / 128]."""
    rows, cols = scale_inv.shape
    padded = torch.zeros(rows, -(-cols // 4) * 4, dtype=torch.float32, device=scale_inv.device)
    padded[:, :cols] = scale_inv
    return padded.t()


def scaled_mm_case(name: str, M: int, flops_s: float) -> list[str]:
    """One projection at M tokens: bf16 torch.mm, FP8 with and without the rows' quantization."""
    from moelora.kernels.fp8_block import dequantize_fp8_block, quantize_fp8_block
    from moelora.kernels.moe.fp8 import quantize_rows_fp8
    from moelora.kernels.reference import quantize_rows_fp8 as reference_rows

    N, K = PROJECTIONS[name]
    w = [torch.randn(N, K, dtype=DT, device=DEV) * K**-0.5 for _ in range(LAYERS)]
    fp8 = [quantize_fp8_block(wi) for wi in w]
    ws_op = [scaled_mm_weight_scales(s) for _, s in fp8]
    x = torch.randn(M, K, dtype=DT, device=DEV)
    xq, xs = quantize_rows_fp8(x)
    got = _block_scaled_mm(xq, xs, fp8[0][0], ws_op[0]).float()
    rq, rs = reference_rows(x)
    rows = (rq.float().view(M, -1, 128) * rs[..., None]).view(M, K)
    want = rows @ dequantize_fp8_block(*fp8[0], torch.float32).t()
    err = ((got - want).norm() / want.norm()).item()
    runs = {
        "bf16 torch.mm (cuBLAS)": lambda i: torch.mm(x, w[i].t()),
        "FP8 scaled_mm, rows quantized": lambda i: _block_scaled_mm(xq, xs, fp8[i][0], ws_op[i]),
        "FP8 quantize_rows_fp8 + scaled_mm": lambda i: _block_scaled_mm(
            *quantize_rows_fp8(x), fp8[i][0], ws_op[i]
        ),
    }
    floor = 1e6 * 2 * M * N * K / flops_s
    lines = []
    for label, run in runs.items():
        us = 1e3 * graph_ms(lambda run=run: [run(i) for i in range(LAYERS)], LAYERS)
        line = f"| {name} | {M} | {label} | {us:.1f} | {floor:.1f} / {floor / 2:.1f} | "
        lines.append(line + f"{us / floor:.2f} |")
        print(lines[-1], flush=True)
    return lines + [f"| {name} | {M} | FP8 against the codes' float32 product: {err:.1e} | | | |"]


def scaled_mm_check(args: argparse.Namespace) -> list[str]:
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return [f"- torch {torch.__version__} has no torch.nn.functional.scaled_mm / ScalingType"]
    flops_s = matmul_flops_per_s(DEV)
    lines = [
        f"- matmul throughput (8192^3 bf16 torch.mm): {flops_s / 1e12:.0f} TFLOP/s",
        f"- qwen3-30b-a3b's projections; {LAYERS} layers a graph",
        "",
        "| projection | tokens | what | µs a layer | floor µs bf16 / FP8 | x bf16 floor |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for name in PROJECTIONS:
        for M in args.ms:
            torch.manual_seed(0)
            lines += scaled_mm_case(name, M, flops_s)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=["grouped-mm", "fla", "scaled-mm"])
    parser.add_argument("--shapes", nargs="+", choices=list(MOE_SHAPES), default=GMM_SHAPES)
    parser.add_argument("--ms", nargs="+", type=int, default=[1024, 4096, 16384])
    parser.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--out", help="result file (default: a dated one in bench/results)")
    args = parser.parse_args()
    if args.check == "grouped-mm":
        title, lines = "torch._grouped_mm against fused_moe's base", grouped_mm_check(args)
    elif args.check == "scaled-mm":
        title = "torch's block-scaled FP8 GEMM against bf16 on the dense projections"
        lines = scaled_mm_check(args)
    else:
        title, lines = "fla-core's chunk_gated_delta_rule against ours", fla_check(args)
    write_result(f"library-{args.check}", result_header(title, None) + lines, args.out)


if __name__ == "__main__":
    main()
