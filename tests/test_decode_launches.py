"""How many kernels one decode step launches, per architecture, counted on the CPU.

A decode step is a chain of small kernels, and each costs launch and drain time in its CUDA
graph even when it does little (DESIGN.md); a torch elementwise op between two Triton kernels
also breaks their programmatic dependent launch (kernels/pdl.py). So each family's step has a
budget: the model is built on the Triton table with CPU tensors, every Triton launch is
recorded instead of run (outputs are never read), and every aten op that would launch a CUDA
kernel is counted (views and allocations do not). The budgets are today's counts: a change
that adds a launch to a decode step fails here and says which.

`count_decode_launches` is also the diagnostic: `python tests/test_decode_launches.py SHAPE
LAYERS [lora]` prints a step's launches by kernel.
"""

from __future__ import annotations

import collections
import sys
import tempfile

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moelora.engine.kv_cache import allocate_kv_caches
from moelora.kernels.ops import triton_ops
from moelora.lora.slots import SlotPool
from moelora.models.loader import settle
from moelora.models.model import MoeCausalLM
from moelora.models.registry import read_model_config
from moelora.models.shapes import shape_config, write_config_folder
from moelora.step.batch import AttentionMetadata, ForwardBatch
from moelora.step.lora import NO_SLOT, LoraBatchInfo

# aten ops that launch no kernel: views, metadata and allocations
NO_KERNEL = frozenset(
    "view _unsafe_view split split_with_sizes unbind slice select as_strided t transpose "
    "permute expand alias detach empty empty_like empty_strided new_empty unsqueeze squeeze "
    "reshape _reshape_alias view_as lift_fresh chunk narrow diagonal unfold".split()
)


class _AtenLaunches(TorchDispatchMode):
    """Counts the aten ops that would launch a kernel on a GPU (a cast or contiguous() that
    returns its input launches nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        same = args and isinstance(out, torch.Tensor) and out is args[0]
        if name not in NO_KERNEL and not same:
            self.ops[name] += 1
        return out


def count_decode_launches(
    shape: str, layers: int, *, lora: bool, batch: int = 8, context: int = 64
) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """(Triton launches, aten kernel ops) of one decode step of `batch` sequences at `context`
    tokens, on the named shape cut to `layers` layers (empty weights: nothing is computed).
    lora: the LoRA graph's step with no adapter in it (a slot pool, no slot enabled)."""
    from triton.runtime.jit import KernelInterface

    launches: collections.Counter[str] = collections.Counter()

    def record(kernel, grid):
        return lambda *args, **kwargs: launches.update([kernel.fn.__name__])

    with tempfile.TemporaryDirectory() as folder:
        cfg, hf = read_model_config(
            str(write_config_folder(shape_config(shape, num_layers=layers), folder))
        )
    cpu, dtype = torch.device("cpu"), torch.bfloat16
    model = MoeCausalLM(
        cfg, hf, 4 * context, triton_ops("batch-invariant"), dtype=dtype, device=cpu
    )
    settle(model)  # as the engine's load does
    page = 16
    pages = context // page + 1
    caches = allocate_kv_caches(
        cfg, batch * pages, page, dtype=dtype, device=cpu, num_state_slots=batch
    )
    cu = torch.arange(batch + 1, dtype=torch.int32)
    attn = AttentionMetadata(
        cu,
        torch.full((batch,), context, dtype=torch.int32),
        torch.arange(batch * pages, dtype=torch.int32).view(batch, pages),
        torch.arange(batch, dtype=torch.int64) * pages * page + context - 1,
        1,
        state_slots=torch.arange(batch, dtype=torch.int32) if cfg.linear_attention else None,
    )
    info = None
    if lora:
        pool = SlotPool(model, 4, 16, dtype=dtype, device=cpu)
        info = LoraBatchInfo(
            torch.full((batch,), NO_SLOT, dtype=torch.int32),
            pool.rank_of_slot,
            pool.scaling_of_slot,
            torch.zeros(4, dtype=torch.int32),
        )
    positions = torch.full((batch,), context - 1, dtype=torch.int64)
    step = ForwardBatch(torch.zeros(batch, dtype=torch.int64), positions, attn, info)
    aten = _AtenLaunches()
    original = KernelInterface.__getitem__
    KernelInterface.__getitem__ = record
    try:
        with torch.no_grad(), aten:
            model(step, caches)
    finally:
        KernelInterface.__getitem__ = original
    return launches, aten.ops


# (shape, layers, lora): (Triton launches, aten ops allowed) of one decode step. Moonlight,
# DeepSeek-V2-Lite and GLM-4.5-Air: a dense layer, then MoE; Qwen3.5: three gated DeltaNet
# layers, then gated attention. The aten ops: the embedding gather.
BUDGETS = {
    ("moonlight-16b-a3b", 4, False): (57, {"embedding": 1}),
    ("moonlight-16b-a3b", 4, True): (61, {"embedding": 1}),
    ("glm-4.5-air", 2, False): (23, {"embedding": 1}),
    ("glm-4.5-air", 2, True): (25, {"embedding": 1}),
    ("qwen3.5-moe-35b-a3b", 4, False): (57, {"embedding": 1}),
    ("qwen3.5-moe-35b-a3b", 4, True): (62, {"embedding": 1}),
    ("deepseek-v2-lite", 2, True): (29, {"embedding": 1}),
    ("gpt-oss-20b", 2, False): (23, {"embedding": 1}),
    ("qwen3-30b-a3b", 2, False): (23, {"embedding": 1}),
    ("qwen3-30b-a3b", 2, True): (25, {"embedding": 1}),
}


@pytest.mark.parametrize("shape,layers,lora", sorted(BUDGETS))
def test_a_decode_step_keeps_its_launch_budget(shape, layers, lora):
    pytest.importorskip("triton")
    launches, aten = count_decode_launches(shape, layers, lora=lora)
    budget, allowed = BUDGETS[shape, layers, lora]
    assert sum(launches.values()) <= budget, dict(launches)
    extra = {op: n for op, n in aten.items() if n > allowed.get(op, 0)}
    assert not extra, f"torch kernels in the decode step: {extra}"
    assert launches["_rms_norm_kernel"] > 0  # the recording saw the step's kernels


if __name__ == "__main__":
    found = count_decode_launches(sys.argv[1], int(sys.argv[2]), lora="lora" in sys.argv[3:])
    total = sum(found[0].values()) + sum(found[1].values())
    print(f"{sys.argv[1:]}: {total} launches", *(dict(c.most_common()) for c in found), sep="\n")
