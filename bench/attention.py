"""Decode attention per layer vs its memory floor, for the Qwen3-30B-A3B attention shape.

A decode step of LAYERS layers (each with its own KV cache, one page table for all, as in the
engine) is captured in one CUDA graph and replayed with the L2 cache flushed before each replay;
the figure is the replay time divided by LAYERS, so graph launch costs are spread as in a model.
A one-layer graph is timed too (one replay: launch latency included). The floor is the KV bytes
a layer must read divided by the copy bandwidth measured in the same run (a large device-to-device
copy, counting read + write). Also times one eager 4096-token prefill. `--sweep` times other
tiles and split counts. `--prefill` times causal prefills of 4096 and 16384 tokens at
PREFILL_CONFIG and at other tiles instead, beside the matmul floor (FLOPs over an 8192^3 bf16
torch.mm's throughput, measured in the same run).

    PYTHONPATH=. python bench/attention.py [--sweep | --prefill] [--out PATH]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace

import torch
from common import copy_bandwidth, graph_replay_ms, result_header, write_result
from triton.testing import do_bench

from moelora.kernels.attention.paged import (
    PREFILL_CONFIG,
    AttentionConfig,
    decode_plan,
    launch_paged_attention,
    paged_attention,
)
from moelora.step.batch import AttentionMetadata

HQ, HKV, D, PAGE = 32, 4, 128, 16
DTYPE = torch.bfloat16
LAYERS = 16
BATCHES = (1, 8, 64)
CONTEXTS = (512, 4096)
SWEEP_CONFIGS = [
    AttentionConfig(block_m=16, block_n=32, num_warps=4, num_stages=2),
    AttentionConfig(block_m=16, block_n=64, num_warps=4, num_stages=2),
    AttentionConfig(block_m=16, block_n=64, num_warps=4, num_stages=3),
    AttentionConfig(block_m=16, block_n=128, num_warps=4, num_stages=2),
    AttentionConfig(block_m=16, block_n=64, num_warps=8, num_stages=2),
    AttentionConfig(block_m=16, block_n=128, num_warps=8, num_stages=2),
]
SPLIT_FACTORS = (0.5, 1.0, 2.0)


def decode_step(batch: int, context: int, layers: int):
    """q [B, Hq, D], `layers` pairs of random caches, and metadata with random page tables."""
    pages_per_seq = context // PAGE
    num_pages = batch * pages_per_seq
    caches = [
        tuple(torch.randn(num_pages, PAGE, HKV, D, device="cuda", dtype=DTYPE) for _ in "kv")
        for _ in range(layers)
    ]
    page_table = torch.randperm(num_pages, device="cuda").to(torch.int32)
    attn = AttentionMetadata(
        cu_seqlens_q=torch.arange(batch + 1, device="cuda", dtype=torch.int32),
        seq_lens=torch.full((batch,), context, device="cuda", dtype=torch.int32),
        page_table=page_table.view(batch, pages_per_seq),
        slot_mapping=torch.zeros(batch, device="cuda", dtype=torch.int64),
        max_query_len=1,
    )
    q = torch.randn(batch, HQ, D, device="cuda", dtype=DTYPE)
    return q, caches, attn


def time_graph(fn: Callable[[], None], rep_ms: int = 100) -> float:
    """Median µs of one replay of a CUDA graph of fn, L2 flushed before each replay."""
    return graph_replay_ms(fn, warmup=25, rep=rep_ms) * 1e3


def time_decode(step, layers: int, rep_ms: int = 100, **launch) -> float:
    """µs per layer of a graph of `layers` decode layers (launch: config, num_splits)."""
    q, caches, attn = step

    def run():
        for k_cache, v_cache in caches[:layers]:
            launch_paged_attention(q, k_cache, v_cache, attn, D**-0.5, **launch)

    return time_graph(run, rep_ms) / layers


def time_prefill(tokens: int, config: AttentionConfig | None = None) -> tuple[float, float]:
    """Median ms and TFLOP/s of one causal prefill of `tokens` tokens (eager)."""
    _, [(k_cache, v_cache)], attn = decode_step(1, tokens, 1)
    q = torch.randn(tokens, HQ, D, device="cuda", dtype=DTYPE)
    cu = torch.tensor([0, tokens], device="cuda", dtype=torch.int32)
    attn = replace(attn, cu_seqlens_q=cu, max_query_len=tokens)
    ms = do_bench(
        lambda: launch_paged_attention(q, k_cache, v_cache, attn, D**-0.5, config=config),
        return_mode="median",
    )
    flops = 2 * 2 * HQ * D * tokens * tokens / 2  # QK^T and PV, causal half
    return ms, flops / (ms * 1e-3) / 1e12


def measure(bandwidth: float, sweep: bool) -> tuple[list, list]:
    """Rows (B, context, splits, µs, 1-layer µs, floor µs, TB/s) and, with sweep, the sweep's
    rows (B, context, config, splits, µs, × floor)."""
    rows, sweep_rows = [], []
    for batch in BATCHES:
        for context in CONTEXTS:
            step = decode_step(batch, context, LAYERS)
            _, splits = decode_plan(batch, HKV, context, step[0].device)
            us = time_decode(step, LAYERS)
            single_us = time_decode(step, 1)
            kv_bytes = 2 * batch * context * HKV * D * step[0].element_size()
            floor_us = kv_bytes / bandwidth * 1e6
            tbs = kv_bytes / (us * 1e-6) / 1e12
            rows.append((batch, context, splits, us, single_us, floor_us, tbs))
            if sweep:
                for config in SWEEP_CONFIGS:
                    for factor in SPLIT_FACTORS:
                        s = max(1, min(round(splits * factor), context // config.block_n))
                        t = time_decode(step, LAYERS, 40, config=config, num_splits=s)
                        sweep_rows.append((batch, context, config, s, t, t / floor_us))
            del step
            torch.cuda.empty_cache()
    return rows, sweep_rows


def sweep_table(sweep_rows: list) -> list[str]:
    """The best tile and split count of each (B, context)."""
    for batch, context, c, s, t, ratio in sweep_rows:
        print(f"sweep B={batch} ctx={context} {c} splits={s}: {t:.1f} µs ({ratio:.2f}x)")
    header = "| B | context | block_n | warps | stages | splits | µs | × floor |"
    lines = ["", "## Best of the sweep", "", header, "|---:" * 8 + "|"]
    for batch in BATCHES:
        for context in CONTEXTS:
            shape_rows = [r for r in sweep_rows if r[:2] == (batch, context)]
            _, _, c, s, t, ratio = min(shape_rows, key=lambda r: r[4])
            lines.append(
                f"| {batch} | {context} | {c.block_n} | {c.num_warps} | {c.num_stages} "
                f"| {s} | {t:.1f} | {ratio:.2f} |"
            )
    return lines


PREFILL_TILES = [
    PREFILL_CONFIG,
    AttentionConfig(block_m=128, block_n=64, num_warps=4, num_stages=3),
    AttentionConfig(block_m=128, block_n=128, num_warps=8, num_stages=2),
    AttentionConfig(block_m=256, block_n=64, num_warps=8, num_stages=2),
    AttentionConfig(block_m=256, block_n=128, num_warps=8, num_stages=2),
    AttentionConfig(block_m=256, block_n=128, num_warps=16, num_stages=2),
    AttentionConfig(block_m=256, block_n=64, num_warps=16, num_stages=3),
]


def time_sdpa(tokens: int, backend) -> tuple[float, float, str]:
    """Median ms and TFLOP/s of torch's scaled_dot_product_attention on one backend, causal,
    the same shape with contiguous K/V (no pages); GQA by enable_gqa, else K/V repeated."""
    from torch.nn.attention import sdpa_kernel

    q = torch.randn(1, HQ, tokens, D, device="cuda", dtype=DTYPE)
    k, v = (torch.randn(1, HKV, tokens, D, device="cuda", dtype=DTYPE) for _ in "kv")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    flops = 2 * 2 * HQ * D * tokens * tokens / 2
    with sdpa_kernel(backend):
        try:
            ms = do_bench(
                lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True), return_mode="median"
            )
            how = "enable_gqa"
        except RuntimeError:
            k, v = (t.repeat_interleave(HQ // HKV, dim=1) for t in (k, v))
            ms = do_bench(lambda: sdpa(q, k, v, is_causal=True), return_mode="median")
            how = "K/V repeated"
    return ms, flops / (ms * 1e-3) / 1e12, how


def first_chunk(tokens: int):
    """q, caches and the metadata of one sequence's first chunk of `tokens` tokens (its KV the
    step's own, its rows' slots given, as the engine's prefill has them)."""
    _, [(k_cache, v_cache)], attn = decode_step(1, tokens, 1)
    pages = attn.page_table[0].long()
    pos = torch.arange(tokens, device="cuda")
    attn = replace(
        attn,
        cu_seqlens_q=torch.tensor([0, tokens], device="cuda", dtype=torch.int32),
        max_query_len=tokens,
        slot_mapping=pages[pos // PAGE] * PAGE + pos % PAGE,
        chunks=((0, tokens),),
    )
    q = torch.randn(tokens, HQ, D, device="cuda", dtype=DTYPE)
    return q, k_cache, v_cache, attn


def host_rows(tokens: int) -> list[str]:
    """Host µs a call (50 calls enqueued, no sync between) and device ms of one first chunk's
    attention: the paged kernel, the engine's cuDNN path (dense_from), and cuDNN's aten op
    called directly (GQA K/V as they are)."""
    import time

    q, k_cache, v_cache, attn = first_chunk(tokens)
    slots = attn.slot_mapping
    k, v = (c.view(-1, HKV, D)[slots].unsqueeze(0).transpose(1, 2) for c in (k_cache, v_cache))
    qd = q.unsqueeze(0).transpose(1, 2)
    aten = torch.ops.aten._scaled_dot_product_cudnn_attention
    paths = {
        "paged kernel": lambda: paged_attention(q, k_cache, v_cache, attn, D**-0.5),
        "cuDNN (dense_from)": lambda: paged_attention(
            q, k_cache, v_cache, attn, D**-0.5, dense_from=tokens
        ),
        "aten cuDNN op, GQA": lambda: aten(qd, k, v, None, False, 0.0, True, False, scale=D**-0.5)[
            0
        ].transpose(1, 2)[0],
    }
    rows = []
    for name, fn in paths.items():
        try:
            fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(50):
                fn()
            host_us = (time.perf_counter() - start) / 50 * 1e6
            torch.cuda.synchronize()
            ms = do_bench(fn, return_mode="median")
        except Exception as e:  # the aten op may refuse GQA
            print(f"host {tokens} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        rows.append(f"| {tokens} | {name} | {host_us:.0f} | {ms:.3f} |")
        print(rows[-1], flush=True)
    if len(rows) == 3:
        same = torch.equal(paths["aten cuDNN op, GQA"](), paths["cuDNN (dense_from)"]())
        print(f"aten op == engine path at {tokens}: {same}", flush=True)
    return rows


def first_call_ms(tokens: int, count: int) -> float:
    """Wall ms of the engine path's first call at a shape not seen before (count first chunks
    of `tokens` each, one run): what cuDNN spends building its plan for a new shape."""
    import time

    q, k_cache, v_cache, attn = first_chunk(tokens * count)
    cu = torch.arange(count + 1, device="cuda", dtype=torch.int32) * tokens
    attn = replace(attn, cu_seqlens_q=cu, max_query_len=tokens, chunks=((0, tokens),) * count)
    attn = replace(attn, seq_lens=torch.full((count,), tokens, device="cuda", dtype=torch.int32))
    attn = replace(attn, page_table=attn.page_table.view(count, -1))
    torch.cuda.synchronize()
    start = time.perf_counter()
    paged_attention(q, k_cache, v_cache, attn, D**-0.5, dense_from=tokens)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def host_lines() -> list[str]:
    lines = ["", "Host and device time a call of one first chunk (all rows dense):", ""]
    lines += ["| tokens | path | host µs a call | device ms |", "|---:|---|---:|---:|"]
    lines += host_rows(2048) + host_rows(4096)
    lines += ["", "First call at a new shape (cuDNN builds a plan), wall ms:", ""]
    lines += ["| tokens | sequences | first call ms | again ms |", "|---:|---:|---:|---:|"]
    for tokens, count in ((4112, 1), (4128, 1), (3008, 1), (2048, 2), (2064, 2), (16400, 1)):
        first, again = first_call_ms(tokens, count), first_call_ms(tokens, count)
        lines.append(f"| {tokens} | {count} | {first:.1f} | {again:.1f} |")
        print(lines[-1], flush=True)
    return lines


def sdpa_lines(peak: float) -> list[str]:
    """torch's own attention backends at the prefill shapes: what a library kernel reaches."""
    from torch.nn.attention import SDPBackend

    lines = ["", "torch.nn.functional.scaled_dot_product_attention, contiguous K/V:", ""]
    lines += ["| tokens | backend | GQA | ms | TFLOP/s | × floor |", "|---:" * 6 + "|"]
    for tokens in (4096, 16384):
        for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
            try:
                ms, tflops, how = time_sdpa(tokens, getattr(SDPBackend, name))
            except Exception as e:  # a backend this build or shape lacks
                print(f"sdpa {tokens} {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            lines.append(
                f"| {tokens} | {name} | {how} | {ms:.3f} | {tflops:.0f} | {peak / tflops:.2f} |"
            )
            print(lines[-1], flush=True)
    return lines


def prefill_lines(bandwidth: float) -> list[str]:
    """Causal prefills at each of PREFILL_TILES beside the matmul floor."""
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    mm_ms = do_bench(lambda: a @ a, return_mode="median")
    peak = 2 * 8192**3 / (mm_ms * 1e-3) / 1e12
    lines = result_header("Paged attention prefill", bandwidth)
    lines += [
        f"- shape: Qwen3-30B-A3B attention, Hq={HQ}, Hkv={HKV}, D={D}, page {PAGE}, bf16; one "
        "sequence, eager launch, do_bench median",
        f"- matmul throughput (8192^3 bf16 torch.mm): {peak:.0f} TFLOP/s; floor = causal FLOPs "
        "(4 Hq D T^2 / 2) over it",
        "",
        "| tokens | block_m | block_n | warps | stages | ms | TFLOP/s | × floor |",
        "|---:" * 8 + "|",
    ]
    for tokens in (4096, 16384):
        for c in PREFILL_TILES:
            try:
                ms, tflops = time_prefill(tokens, c)
            except Exception as e:  # a tile past the shared memory or registers: skip it
                print(f"{tokens} {c}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            row = (tokens, c.block_m, c.block_n, c.num_warps, c.num_stages)
            lines.append(
                "| " + " | ".join(map(str, row)) + f" | {ms:.3f} | {tflops:.0f} | "
                f"{peak / tflops:.2f} |"
            )
            print(lines[-1], flush=True)
    return lines + sdpa_lines(peak) + host_lines()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time other tiles and splits")
    parser.add_argument("--prefill", action="store_true", help="prefill tiles instead (above)")
    parser.add_argument("--out", help="result file (default: a dated one in bench/results)")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.prefill:
        lines = prefill_lines(copy_bandwidth())
        write_result("attention-prefill", lines, args.out)
        return
    bandwidth = copy_bandwidth()
    rows, sweep_rows = measure(bandwidth, args.sweep)
    prefill_ms, prefill_tflops = time_prefill(4096)
    lines = result_header("Paged attention decode", bandwidth)
    lines += [
        f"- shape: Qwen3-30B-A3B attention, Hq={HQ}, Hkv={HKV}, D={D}, page {PAGE}, bf16",
        f"- µs / layer: one graph of {LAYERS} layers (own caches, shared page table), L2 flushed "
        f"before each replay, median replay / {LAYERS}; 1-layer graph: one replay of one layer",
        "",
        "| B | context | splits | µs / layer | floor µs | × floor | KV TB/s | 1-layer graph µs |",
        "|---:" * 8 + "|",
    ]
    for batch, context, splits, us, single_us, floor_us, tbs in rows:
        lines.append(
            f"| {batch} | {context} | {splits} | {us:.1f} | {floor_us:.1f} | "
            f"{us / floor_us:.2f} | {tbs:.2f} | {single_us:.1f} |"
        )
    lines += [
        "",
        f"Prefill, 1 x 4096 tokens (eager): {prefill_ms:.2f} ms, {prefill_tflops:.0f} TFLOP/s.",
    ]
    if sweep_rows:
        lines += sweep_table(sweep_rows)
    write_result("attention", lines, args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
