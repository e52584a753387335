"""The fused MoE's GEMM loops in sm_90 machine code, without a GPU: registers, spills and the main
loop's instructions of `_gate_up_kernel` and `_down_kernel` at a shape's tuned tiles, as Triton
and its bundled ptxas compile them for the H100 / H200 (cuobjdump disassembles). A diagnostic
for the MXFP4 expansion, whose loops are bound by their instructions and registers more than
by memory (bench/results/NOTES.md): try a change here in seconds, then time it on the device.

    python bench/sass_moe.py [--shape gpt-oss-120b | qwen3-30b-a3b | mixtral] [--ms 1 8 64]
        [--expand 2 3] [--fp8]

--expand: the MXFP4 expansions to compile (fused_moe._Experts.expand): 2 bit placement from
the release layout, 3 from the GPU layout (Mxfp4Weight.swizzle_), 1 table lookups (bf16
shapes have none). The launches are recorded from fused_moe on CPU tensors (E narrowed to 2;
H, I and the strides real, so the compiler sees the alignment the device's launches have),
with the LoRA pools recorded as the engine's graphs have them, and compiled with the
expansion set, PDL on, as the H200 runs them. --fp8: the bf16 shapes' experts in block FP8
(kernels/moe/fp8.py's loops) at their FP8 tiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
import triton
from common import batch_info, lora_pool
from triton.runtime.jit import KernelInterface

from moelora.kernels.fp8_block import Fp8Weight, quantize_fp8_block
from moelora.kernels.moe.config import MoeConfig, shape_key, tuned_table
from moelora.kernels.moe.fused import fused_moe
from moelora.kernels.moe.mxfp4_layout import MXFP4_GROUP, Mxfp4Weight

# the CPU suite's sm_90 compile (tests/kernels/test_sm90_compile.py): one way to specialize a
# recorded launch as the H200's JIT would
sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "kernels"))
from test_sm90_compile import compile_sm90  # noqa: E402

# name: experts of the tile table's key, H, I, top-k, MXFP4
SHAPES = {
    "gpt-oss-20b": (32, 2880, 2880, 4, True),
    "gpt-oss-120b": (128, 2880, 2880, 4, True),
    "qwen3-30b-a3b": (128, 2048, 768, 8, False),
    "mixtral": (8, 4096, 14336, 2, False),
}
E = 2  # experts recorded: the loops do not depend on their number
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def tuned(shape: str, m: int, fp8: bool = False) -> MoeConfig:
    """The H200 table's tile for m tokens (the smallest bucket at least m), or its chip
    twin's."""
    experts, H, I, K, mxfp4 = SHAPES[shape]
    table = tuned_table("NVIDIA H200", shape_key(experts, H, I, K, mxfp4=mxfp4, fp8=fp8))
    bucket = min((b for b in map(int, table) if b >= m), default=max(map(int, table)))
    return MoeConfig(**table[str(bucket)])


def record(shape: str, m: int, cfg: MoeConfig, padded: bool, fp8: bool = False) -> list:
    """The GEMM launches of one fused_moe call on CPU tensors: (kernel, kwargs). padded: scale
    rows as the GPU layout pads them (their stride is what the compiler sees); fp8: block-FP8
    experts."""
    _, H, I, K, mxfp4 = SHAPES[shape]
    launches = []
    original = KernelInterface.__getitem__
    KernelInterface.__getitem__ = lambda kernel, grid: (
        lambda *args, **kwargs: launches.append((kernel, kwargs))
    )
    try:
        ws = []
        for n, k in ((2 * I, H), (H, I)):  # w13 [E, 2I, H], w2 [E, H, I]
            if fp8:
                ws.append(Fp8Weight(*quantize_fp8_block(torch.randn(E, n, k) * 0.02)))
                continue
            if not mxfp4:
                ws.append(torch.zeros(E, n, k, dtype=torch.bfloat16))
                continue
            blocks = torch.randint(0, 256, (E, n, k // 2), dtype=torch.uint8)
            w = Mxfp4Weight(blocks, torch.full((E, n, k // MXFP4_GROUP), 120, dtype=torch.uint8))
            if padded:  # the GPU layout's scale rows, kept in the release's bits (CPU launch)
                w = dataclasses.replace(w.with_small_scales().swizzle_(), swizzled=False)
            ws.append(w)
        x = torch.randn(m, H, dtype=torch.bfloat16)
        ids = torch.randint(0, E, (m, K), dtype=torch.int32)
        options = {}
        if mxfp4:  # GPT-OSS's biases and clamped SwiGLU
            options = dict(b13=torch.zeros(E, 2 * I, dtype=torch.bfloat16), activation="swiglu_oai")
            options["b2"] = torch.zeros(E, H, dtype=torch.bfloat16)
        lora13, lora2 = lora_pool(E, H, I, 16, 16, device="cpu")
        info = batch_info(m, "none", 16, device="cpu")
        options |= dict(lora13=lora13, lora2=lora2, info=info)
        fused_moe(x, *ws, torch.rand(m, K), ids, config=cfg, **options)
    finally:
        KernelInterface.__getitem__ = original
    return [(k, kw) for k, kw in launches if k.fn.__name__ in ("_gate_up_kernel", "_down_kernel")]


def loop_mix(cubin: bytes) -> tuple[str, int, Counter]:
    """(resource line, instructions, opcode counts) of the kernel's first loop: from the target
    of its first backward branch to that branch."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.check_output([BIN / "cuobjdump", "-sass", f.name], text=True)
        usage = subprocess.check_output([BIN / "cuobjdump", "-res-usage", f.name], text=True)
    resources = re.search(r"REG:\d+ STACK:\d+", usage).group(0)
    code = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s*(@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*)", line)
        if m:
            code.append((int(m.group(1), 16), m.group(3), m.group(4)))
    for at, op, rest in code:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < at:
            lo = int(target.group(1), 16)
            ops = Counter(o for a, o, _ in code if lo <= a <= at)
            return resources, sum(ops.values()), ops
    return resources, 0, Counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="gpt-oss-120b", choices=SHAPES)
    parser.add_argument("--ms", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--expand", nargs="+", type=int, default=[2, 3], choices=[1, 2, 3])
    parser.add_argument("--fp8", action="store_true", help="block-FP8 experts (bf16 shapes)")
    args = parser.parse_args()
    if args.fp8 and SHAPES[args.shape][4]:
        parser.error(f"--fp8 with --shape {args.shape}: expected a shape of bf16 experts")
    if not SHAPES[args.shape][4]:
        args.expand = [0]  # bf16 experts: no expansion
    print("| M | kernel | expansion | tile | registers | loop instructions | most frequent |")
    print("|---:|---|---:|---|---|---:|---|")
    for m in args.ms:
        cfg = tuned(args.shape, m, args.fp8)
        warps, stages = cfg.down_launch()
        regs = f" r{cfg.max_registers}" if cfg.max_registers else ""
        tiles = {
            "gate_up": f"BN {cfg.block_n} BK {cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}",
            "down": f"BN {cfg.block_n_down} BK {cfg.block_k_down} w{warps} s{stages}",
        }
        for expand in args.expand:
            for kernel, kwargs in record(args.shape, m, cfg, expand == 3, args.fp8):
                expansion = {"MXFP4_EXPAND": expand} if expand else {}
                compiled = compile_sm90(kernel, (), dict(kwargs, **expansion))
                resources, n, ops = loop_mix(compiled.asm["cubin"])
                top = ", ".join(f"{op} {c}" for op, c in ops.most_common(6))
                name = kernel.fn.__name__.strip("_").removesuffix("_kernel")
                tile = tiles[name] + regs
                print(f"| {m} | {name} | {expand} | {tile} | {resources} | {n} | {top} |")


if __name__ == "__main__":
    main()
