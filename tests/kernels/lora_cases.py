"""Random inputs for the kernel tests (CPU interpreter and GPU): weights, adapters, batch info.

Slots carry ranks {0, 1, 8, 16} (mixed in one pool of max rank R); rows of A and columns of B
past a slot's rank are zero, as the slot loader guarantees. The adapter spreads follow punica:
none enabled, one adapter for every token, a distinct adapter per token, and a mix where some
tokens use the base model.
"""

from __future__ import annotations

import torch

from moelora.kernels.fp8_block import FP8_BLOCK, Fp8Weight, fp8_scale_shape, quantize_fp8_block
from moelora.kernels.moe.mxfp4_layout import Mxfp4Weight
from moelora.step.lora import (
    A_EXPERT,
    A_OFF,
    A_SLICE,
    B_EXPERT,
    B_OFF,
    B_ROW,
    NO_SLOT,
    RANK,
    TABLE_WIDTH,
    LoraBatchInfo,
    LoraWeights,
)

SLOT_RANKS = (0, 1, 8, 16)
SPREADS = ("none", "one", "distinct", "mixed")


def lora_weights(
    S: int,
    lead: tuple[int, ...],
    n: int,
    R: int,
    in_dim: int,
    out_slices: tuple[int, ...],
    ranks: torch.Tensor,
    dtype: torch.dtype,
    device: str = "cpu",
) -> LoraWeights:
    """A [S, *lead, n, R, in], B [S, *lead, out, R], zero past each slot's rank. The scales make
    the delta comparable to the base output, so a wrong delta shows in the error."""
    g = torch.Generator(device="cpu").manual_seed(int(torch.randint(0, 2**31, (1,))))
    a = torch.randn(S, *lead, n, R, in_dim, generator=g) / in_dim**0.5
    b = torch.randn(S, *lead, sum(out_slices), R, generator=g) / 4**0.5
    for s, r in enumerate(ranks.tolist()):
        a[s, ..., r:, :] = 0
        b[s, ..., r:] = 0
    return LoraWeights.dense(a.to(device, dtype), b.to(device, dtype), out_slices, ranks.tolist())


def compact_weights(
    dense: LoraWeights, ranks: list[int], shared: tuple[str, ...] = ()
) -> LoraWeights:
    """The factors of `dense` (zeros past each slot's rank) in the arena's compact layout: slot
    s's A [(E | 1,) n, r_s, in] and B [(E | 1,) out, r_s] at r_s = ranks[s] (0: no module),
    regions in reverse slot order with NaN gaps between them (a read outside a slot's factors
    shows); a factor named in `shared` ("a", "b") is expert 0's, stored once (expert stride
    0), and copied to every expert of `dense` so both describe the same weights."""
    a, b = dense.a.clone(), dense.b.clone()
    experts = a.ndim == 5
    for factor in shared if experts else ():
        t = a if factor == "a" else b
        t[:] = t[:, :1]
    table = torch.zeros(len(ranks), TABLE_WIDTH, dtype=torch.int64)
    pieces, at = [], 0
    for s in reversed(range(len(ranks))):
        r = ranks[s]
        if r == 0:
            continue
        a_s, b_s = a[s, ..., :r, :], b[s, ..., :r]
        a_s = a_s[:1] if experts and "a" in shared else a_s
        b_s = b_s[:1] if experts and "b" in shared else b_s
        row = table[s]
        row[A_OFF], row[A_SLICE] = at + 64, r * dense.in_features
        row[A_EXPERT] = a_s[0].numel() if experts and "a" not in shared else 0
        row[B_OFF] = at + 64 + a_s.numel() + 64
        row[B_ROW], row[RANK] = r, r
        row[B_EXPERT] = b_s[0].numel() if experts and "b" not in shared else 0
        gap = torch.full((64,), float("nan"), dtype=a.dtype, device=a.device)
        pieces += [gap, a_s.reshape(-1), gap, b_s.reshape(-1)]
        at += 128 + a_s.numel() + b_s.numel()
    pieces.append(torch.full((64,), float("nan"), dtype=a.dtype, device=a.device))
    arena = torch.cat(pieces)
    return LoraWeights(
        arena,
        table.to(a.device),
        dense.out_slices,
        dense.in_features,
        dense.max_rank,
        dense.num_experts,
    ), LoraWeights.dense(a, b, dense.out_slices, ranks)


def mxfp4_weight(
    E: int, N: int, K: int, scales: tuple[int, int], device: str = "cpu"
) -> Mxfp4Weight:
    """Packed experts [E, N, K] of random codes (every byte value) and random scale bytes in
    [scales[0], scales[1]]: 2^(s - 127) times codes of up to 6; small_scales set from them."""
    g = torch.Generator(device="cpu").manual_seed(int(torch.randint(0, 2**31, (1,))))
    blocks = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8)
    low, high = scales
    scale_bytes = torch.randint(low, high + 1, (E, N, K // 32), generator=g, dtype=torch.uint8)
    return Mxfp4Weight(blocks.to(device), scale_bytes.to(device)).with_small_scales()


def fp8_weight(E: int, N: int, K: int, octaves: float, device: str = "cpu") -> Fp8Weight:
    """Block-FP8 experts [E, N, K] quantized from random weights of about 1/sqrt(K), each
    128 x 128 block scaled by its own 2^u, u uniform in [-octaves / 2, octaves / 2]: blocks of
    different magnitudes, so a tile scaled by another block's scale is far off."""
    rows, cols = fp8_scale_shape((N, K))
    magnitude = 2.0 ** (octaves * (torch.rand(E, rows, cols, device=device) - 0.5))
    block_n = torch.arange(N, device=device) // FP8_BLOCK[0]
    block_k = torch.arange(K, device=device) // FP8_BLOCK[1]
    w = torch.randn(E, N, K, device=device) / K**0.5
    w *= magnitude[:, block_n][:, :, block_k]
    return Fp8Weight(*quantize_fp8_block(w))


def batch_info(T: int, spread: str, device: str = "cpu", num_slots: int = 8) -> LoraBatchInfo:
    """Batch info for T tokens over slots of SLOT_RANKS (cycled to num_slots)."""
    ranks = torch.tensor([SLOT_RANKS[s % len(SLOT_RANKS)] for s in range(num_slots)])
    usable = [s for s in range(num_slots) if ranks[s] > 0]
    if spread == "none":
        slots = torch.full((T,), NO_SLOT)
    elif spread == "one":
        slots = torch.full((T,), usable[-1])
    elif spread == "distinct":  # every slot, the rank-0 one included, in turn
        slots = torch.arange(T) % num_slots
    elif spread == "mixed":
        slots = torch.randint(-1, num_slots, (T,))
        slots[0] = NO_SLOT
    else:
        raise ValueError(spread)
    enabled = torch.zeros(num_slots, dtype=torch.int32)
    for s in slots.tolist():
        if s >= 0 and ranks[s] > 0:
            enabled[s] = 1
    scaling = torch.rand(num_slots) + 0.5
    return LoraBatchInfo(
        slots.to(device, torch.int32),
        ranks.to(device, torch.int32),
        scaling.to(device),
        enabled.to(device),
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((out.float() - ref).norm() / ref.norm().clamp(min=1e-12)).item()
