"""An adapter's part for one rank, cut the way its base weight is (models/shard.py).

- column-parallel (q|k|v, gate|up, the experts' w13 under TP): A whole, B's output rows split;
- row-parallel (o, down, the experts' w2 under TP): A's input columns split, B whole. Each rank
  then adds scaling * (x_r @ A_r.T) @ B.T to its partial output, and the one all-reduce that
  sums the base's partials sums these to scaling * (x @ A.T) @ B.T: no collective of its own;
- EP: each rank the LoRA of its experts.
Ranks and scalings are the adapter's, on every rank: the slots' early exits agree.
"""

from __future__ import annotations

import dataclasses

import torch

from moelora.config import ModelConfig
from moelora.lora.adapter import LoraAdapter, ModuleLora
from moelora.lora.slots import LoraTarget
from moelora.models.shard import cols, experts, gate_up_rows, heads
from moelora.parallel import Shard


def shard_adapter(adapter: LoraAdapter, shard: Shard, cfg: ModelConfig) -> LoraAdapter:
    if shard.size == 1:
        return adapter
    modules = {k: _module_part(k, m, shard, cfg) for k, m in adapter.modules.items()}
    return dataclasses.replace(adapter, modules=modules)


def _module_part(key: str, m: ModuleLora, shard: Shard, cfg: ModelConfig) -> ModuleLora:
    kind = key.split(".", 2)[2]  # qkv, o, mlp.gate_up, shared.down, experts13, ...
    a, b = m.a, m.b  # a [(E,) n, r, in], b [(E,) out, r]
    if kind == "qkv":
        q, k, v = b.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
        kv = [heads(x, shard, cfg, kv=True) for x in (k, v)]
        b = torch.cat([heads(q, shard, cfg, kv=False), *kv])
    elif kind == "o":
        a = heads(a, shard, cfg, kv=False, dim=-1)
    elif kind.endswith("gate_up"):
        b = gate_up_rows(b, shard, dim=0)
    elif kind.endswith("down"):
        a = cols(a, shard)
    elif shard.expert_parallel:
        a, b = experts(a, shard), experts(b, shard)
    elif kind == "experts13":
        b = gate_up_rows(b, shard, dim=1)
    else:  # experts2
        a = cols(a, shard)
    return ModuleLora(a.contiguous(), b.contiguous())


def full_targets(
    local: dict[str, LoraTarget], shard: Shard, cfg: ModelConfig
) -> dict[str, LoraTarget]:
    """The whole model's targets, from this rank's: what an adapter is parsed and checked
    against before it is cut (owners are this rank's modules; parsing never writes them)."""
    if shard.size == 1:
        return local
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    sizes = {
        "qkv": (H, (cfg.q_size, cfg.kv_size, cfg.kv_size)),
        "o": (cfg.q_size, (H,)),
        "mlp.gate_up": (H, (cfg.intermediate_size,) * 2),
        "mlp.down": (cfg.intermediate_size, (H,)),
        "shared.gate_up": (H, (cfg.shared_expert_intermediate_size,) * 2),
        "shared.down": (cfg.shared_expert_intermediate_size, (H,)),
        "experts13": (H, (I, I)),
        "experts2": (I, (H,)),
    }
    found = {}
    for key, t in local.items():
        in_features, out_slices = sizes[key.split(".", 2)[2]]
        num_experts = cfg.num_experts if t.num_experts else 0
        found[key] = dataclasses.replace(
            t, in_features=in_features, out_slices=out_slices, num_experts=num_experts
        )
    return found
