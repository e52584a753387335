"""Tensor / expert parallel sharding of a model: which sizes a rank count must divide, and each
parameter's part for one rank, cut from the whole model.

Column-parallel weights (q|k|v, gate|up, the experts' w13 under TP) keep this rank's output rows
of every slice; row-parallel ones (o, down, the experts' w2 under TP) its input columns, and
their biases live on rank 0 alone (the all-reduce adds them once). EP keeps whole experts.
Routers, norms and the shared expert's gate are replicated.

Legend: N = ranks, r = this rank, E = experts, V = vocabulary.
"""

from __future__ import annotations

import torch

from moelora.config import ModelConfig
from moelora.errors import ConfigError
from moelora.models.loader import check_filled, placed_tensors
from moelora.models.model import MoeCausalLM, one_rank_only
from moelora.parallel import Shard


def check_divides(cfg: ModelConfig, size: int, *, expert_parallel: bool) -> None:
    """ConfigError unless tensor_parallel_size=size can split this model: the query heads, the
    KV heads (or N a multiple of them, which are then replicated), the experts (EP) or their
    intermediate size (TP), and the dense / shared-expert intermediate sizes."""
    if size == 1:
        return
    what = f"tensor_parallel_size={size}"
    if one_rank_only(cfg):  # before any rank starts (models/model.py refuses it too)
        raise ConfigError(f"{what} is not supported for {cfg.arch}: expected 1")
    sizes = [("query heads", "num_attention_heads", cfg.num_heads)]
    if expert_parallel:
        sizes.append(("experts (enable_expert_parallel)", "num_experts", cfg.num_experts))
    else:
        sizes.append(
            ("experts' intermediate size", "moe_intermediate_size", cfg.moe_intermediate_size)
        )
    if not all(cfg.sparse_layers):
        sizes.append(
            ("dense layers' intermediate size", "intermediate_size", cfg.intermediate_size)
        )
    if cfg.shared_expert_intermediate_size:
        shared = cfg.shared_expert_intermediate_size
        sizes.append(("shared expert's size", "shared_expert_intermediate_size", shared))
    for label, key, n in sizes:
        if n % size:
            raise ConfigError(f"{what} does not divide the model's {label}: {key}={n}")
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        raise ConfigError(
            f"{what} does not fit the model's KV heads: num_key_value_heads={kv}, expected a "
            f"multiple of {size} or a divisor of it (each KV head then replicated)"
        )
    if cfg.experts_mxfp4:
        raise ConfigError(f"{what} with MXFP4 experts kept packed is not supported")


def load_shard(local: MoeCausalLM, whole: MoeCausalLM, model_path: str, shard: Shard) -> None:
    """Every parameter of `local` (built for `shard`) filled with its part of the checkpoint's.
    `whole` is the whole model on the meta device: its views say where each checkpoint tensor
    goes. A parameter is held whole in host memory only from its first tensor to its last, so
    a rank never holds the whole checkpoint."""
    names = {id(p): n for n, p in whole.named_parameters()}
    params = dict(local.named_parameters())
    pending: dict[int, torch.Tensor] = {}  # id(parameter of whole) -> its host copy so far
    filled: dict[int, int] = {}  # id(parameter of whole) -> elements written
    for target, source in placed_tensors(whole, model_path):
        base = target if target._base is None else target._base
        key = id(base)
        if key not in pending:
            pending[key] = torch.empty(base.shape, dtype=base.dtype)
        view = pending[key].as_strided(target.shape, target.stride(), target.storage_offset())
        view.copy_(source)
        filled[key] = filled.get(key, 0) + target.numel()
        if filled[key] >= base.numel():
            name = names[key]
            params[name].copy_(part(name, pending.pop(key), shard, whole.cfg))
    check_filled(whole, filled, model_path)


def part(name: str, t: torch.Tensor, shard: Shard, cfg: ModelConfig) -> torch.Tensor:
    """This rank's part of the whole parameter `name`."""
    leaf = name.rsplit(".", 2)[-2:]
    if name in ("embed_tokens", "lm_head"):
        return vocab_rows(t, shard)
    if "self_attn" in name:
        return _attention_part(leaf, t, shard, cfg)
    if name.endswith(("gate_up_proj.weight", "gate_up_proj.bias")):
        return gate_up_rows(t, shard, dim=0)
    if name.endswith("down_proj.weight"):
        return cols(t, shard)
    if leaf[-1] in ("w13", "w13_bias"):
        if shard.expert_parallel:
            return experts(t, shard)
        return gate_up_rows(t, shard, dim=1)
    if leaf[-1] == "w2":
        return experts(t, shard) if shard.expert_parallel else cols(t, shard)
    if leaf[-1] == "w2_bias":
        return experts(t, shard) if shard.expert_parallel else on_rank0(t, shard)
    return t  # routers, norms, the shared expert's gate


def _attention_part(leaf: list[str], t: torch.Tensor, shard: Shard, cfg: ModelConfig):
    module, kind = leaf
    if module == "qkv_proj":
        q, k, v = t.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
        kv = [heads(x, shard, cfg, kv=True) for x in (k, v)]
        return torch.cat([heads(q, shard, cfg, kv=False), *kv])
    if module == "o_proj":
        return heads(t, shard, cfg, kv=False, dim=1) if kind == "weight" else on_rank0(t, shard)
    if module == "q_norm" and cfg.qk_norm == "full":
        return heads(t, shard, cfg, kv=False)
    if module == "k_norm" and cfg.qk_norm == "full":
        return heads(t, shard, cfg, kv=True)
    if kind == "sinks":
        return t.chunk(shard.size)[shard.rank]
    return t  # per-head q/k norms


def heads(t: torch.Tensor, shard: Shard, cfg: ModelConfig, *, kv: bool, dim: int = 0):
    """The rows (or columns) of this rank's query heads, or of its KV heads."""
    D = cfg.head_dim
    if kv:
        first, n = shard.first_kv_head(cfg.num_kv_heads), shard.kv_heads(cfg.num_kv_heads)
    else:
        n = shard.heads(cfg.num_heads)
        first = shard.rank * n
    return t.narrow(dim, first * D, n * D)


def vocab_rows(t: torch.Tensor, shard: Shard) -> torch.Tensor:
    rows = shard.vocab(t.shape[0])
    out = torch.zeros(rows, *t.shape[1:], dtype=t.dtype)
    held = t[shard.rank * rows : (shard.rank + 1) * rows]
    out[: held.shape[0]] = held
    return out


def gate_up_rows(t: torch.Tensor, shard: Shard, *, dim: int) -> torch.Tensor:
    """Gate rows then up rows [.., 2I, ..] -> this rank's gate rows then its up rows."""
    gate, up = t.chunk(2, dim=dim)
    return torch.cat([x.chunk(shard.size, dim=dim)[shard.rank] for x in (gate, up)], dim=dim)


def cols(t: torch.Tensor, shard: Shard) -> torch.Tensor:
    return t.chunk(shard.size, dim=-1)[shard.rank]


def experts(t: torch.Tensor, shard: Shard) -> torch.Tensor:
    return t.chunk(shard.size, dim=0)[shard.rank]


def on_rank0(t: torch.Tensor, shard: Shard) -> torch.Tensor:
    return t if shard.rank == 0 else torch.zeros_like(t)
