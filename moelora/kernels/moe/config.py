"""Tile configs of the fused MoE, kept as data: JSON per device in configs/, keyed by shape and
by token-count bucket (bench/tune_moe.py writes them)."""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"
# Devices on one chip (GH100: 132 multiprocessors, 227 KiB of shared memory each), which differ
# only in memory: a shape tuned on one runs the other's tiles where the other has no table.
SAME_CHIP = (("NVIDIA H100 80GB HBM3", "NVIDIA H200"),)


@dataclass(frozen=True)
class MoeConfig:
    """Tiles of the fused MoE: BM rows (pairs) x BN columns, BK deep; *_down for the down GEMM."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    block_n_down: int = 64
    block_k_down: int = 64
    num_warps: int = 4
    num_stages: int = 3
    # MXFP4 experts in bf16 on the GPU: expand each tile in inline PTX, by bit placement or
    # table lookups as the scales allow (mxfp4.lut_tile_dot), not by a dozen integer
    # operations an element (mxfp4.mxfp4_tile)
    mxfp4_lut: bool = True
    # the down GEMM's own warps and pipeline depth (0: gate_up's): its K is I, often a few
    # tiles deep, so it may want two programs a multiprocessor where gate_up wants one
    num_warps_down: int = 0
    num_stages_down: int = 0
    # registers a thread of both GEMMs may take (ptxas's maxnreg; 0: its own choice): at 4
    # warps, 128 lets 4 programs share a multiprocessor where 130-odd would leave 3 (the
    # MXFP4 loops' expansion is latency-bound: more warps to switch between)
    max_registers: int = 0
    # MXFP4's PTX expansions on sub-tiles this deep (0: the whole BK tile): a tile expanded
    # whole keeps all its bf16 values live before the dots, sub-tiles only theirs (each takes
    # its scale bytes out of the tile's)
    mxfp4_sub_k: int = 0
    # the GEMMs' program order (fused_moe._tile): 0, blocks fastest; G, groups of G blocks each
    # sweeping every column block (prefill: a block's rows and its expert's columns stay in L2)
    group_m: int = 0
    # experts in x's dtype: the GEMMs' weight tiles, and down's block rows of h (contiguous),
    # through TMA descriptors (Hopper and later), where the pointer loads stage each tile
    # through registers and sync the block for it; the gathered x rows stay pointer loads
    tma: bool = False
    # block-FP8 experts on FP8 tensor cores: each tile of x (gate_up) and h (down) quantized
    # per row as it loads (kernels/moe/fp8.py), where the default expands the weight codes to
    # x's dtype; both GEMMs' tiles exactly one block of scales (128) deep
    w8a8: bool = False

    def __post_init__(self) -> None:
        for bk in (self.block_k, self.block_k_down):
            # a sub-tile's scale bytes are split out of its tile's in two halvings at most
            # (mxfp4._scale_part)
            if self.mxfp4_sub_k and bk not in (self.mxfp4_sub_k * n for n in (1, 2, 4)):
                raise ValueError(
                    f"MoeConfig.mxfp4_sub_k {self.mxfp4_sub_k} with tiles {bk} deep: expected "
                    f"1, 2 or 4 sub-tiles a tile"
                )

    def register_limit(self) -> dict:
        """The launch option that caps a thread's registers, if the config sets one."""
        return {"maxnreg": self.max_registers} if self.max_registers else {}

    def down_launch(self) -> tuple[int, int]:
        """(num_warps, num_stages) of the down GEMM."""
        return self.num_warps_down or self.num_warps, self.num_stages_down or self.num_stages


def config_file(device_name: str) -> Path:
    return CONFIG_DIR / f"fused_moe_{device_name.replace(' ', '_')}.json"


def shape_key(E: int, H: int, I: int, K: int, mxfp4: bool = False, fp8: bool = False) -> str:
    """MXFP4 and block-FP8 experts have their own tiles: their main loops are other kernels'."""
    return f"E={E},H={H},I={I},K={K}" + (",mxfp4" if mxfp4 else "") + (",fp8" if fp8 else "")


@functools.cache
def _load_configs(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def default_config(
    T: int,
    E: int,
    H: int,
    I: int,
    K: int,
    device: torch.device,
    *,
    mxfp4: bool = False,
    fp8: bool = False,
) -> MoeConfig:
    """The tuned config for this shape and device (smallest M bucket >= T), else that of a device
    on the same chip, else a default (table_config)."""
    table = {}
    if device.type == "cuda":
        table = tuned_table(torch.cuda.get_device_name(device), shape_key(E, H, I, K, mxfp4, fp8))
    return table_config(table, T, E, K)


def table_config(table: dict, T: int, E: int, K: int) -> MoeConfig:
    """The tiles of table ({bucket: tiles}) for T tokens: its smallest bucket >= T. Past its
    largest bucket the table answers only while T's pairs per expert stay on that bucket's
    side of 16: tiles tuned for decode's few pairs an expert are not extrapolated to a
    prefill's hundreds, which take the default."""
    buckets = sorted(int(m) for m in table)
    bucket = next((m for m in buckets if m >= T), None)
    if bucket is None and buckets and _few_pairs(buckets[-1], E, K) == _few_pairs(T, E, K):
        bucket = buckets[-1]
    if bucket is not None:
        return MoeConfig(**table[str(bucket)])
    # 16-row blocks while the experts average at most 16 pairs: a block holds one expert's
    # pairs, so wider ones would be mostly padding
    return MoeConfig(block_m=16 if _few_pairs(T, E, K) else 64)


def _few_pairs(T: int, E: int, K: int) -> bool:
    """Whether T tokens' T * K pairs average at most 16 an expert."""
    return T * K <= 16 * E


def tuned_table(device_name: str, key: str) -> dict:
    """The shape's {bucket: tiles} of this device's JSON, else of a device on the same chip."""
    twins = next((group for group in SAME_CHIP if device_name in group), ())
    for name in dict.fromkeys((device_name, *twins)):  # its own first, each once
        table = _load_configs(config_file(name)).get(key)
        if table:
            return table
    return {}


def save_configs(
    device_name: str,
    E: int,
    H: int,
    I: int,
    K: int,
    table: dict,
    *,
    mxfp4: bool = False,
    fp8: bool = False,
) -> Path:
    """Write {M bucket: MoeConfig} for one shape into the device's JSON (for bench/tune_moe),
    keeping the shape's other buckets."""
    path = config_file(device_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(path.read_text()) if path.exists() else {}
    # merged into the shape's table: tuning some buckets keeps the others
    entry = data.setdefault(shape_key(E, H, I, K, mxfp4, fp8), {})
    entry.update({str(m): asdict(cfg) for m, cfg in table.items()})
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    _load_configs.cache_clear()
    return path
