"""An engine built, once: the model config resolved, the other ranks started (for
tensor_parallel_size > 1), the kernel table, the model and its weights, the tokenizer and its
grammars, the adapter slots, the KV cache sized to what the memory leaves, the scheduler, the
runner with its CUDA graphs captured, and the adapter registry with the adapters asked for at
start. Engine (engine.py) steps with what this builds and builds nothing itself."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, replace

import torch

from moelora.config import EngineConfig, ModelConfig
from moelora.engine.adapters import AdapterRegistry
from moelora.engine.grammar import Grammars
from moelora.engine.kv_cache import PageAllocator, allocate_kv_caches, page_bytes
from moelora.engine.ranks import kv_config, load_model, make_rank_ops, start_workers
from moelora.engine.scheduler import Scheduler, SchedulerConfig
from moelora.engine.state_cache import StateSlots, StateSnapshots
from moelora.errors import ModelConfigError
from moelora.kernels.fp8_block import FP8_BLOCK
from moelora.kernels.ops import Ops
from moelora.lora.arena import RegionAllocator
from moelora.lora.slots import SlotPool, SlotTable
from moelora.models.loader import stores_fused_experts
from moelora.models.model import MoeCausalLM
from moelora.models.quantization import with_quantization
from moelora.models.registry import read_model_config
from moelora.models.shard import check_divides
from moelora.parallel import SINGLE, Shard
from moelora.runner.model_runner import ModelRunner
from moelora.runner.tp import Workers
from moelora.step.batch import pages_for
from moelora.tokenizer import Tokenizer, eos_ids_from_folder

log = logging.getLogger(__name__)

_CPU_KV_BUDGET = 256 << 20  # bytes of KV cache on CPU when num_pages is not given
_GPU_RESERVE = 2 << 30  # bytes kept free on the GPU for activations and graphs


@dataclass
class EngineParts:
    """What an engine steps with."""

    # experts_mxfp4 and experts_fp8 only where the kernel table keeps them packed
    model_config: ModelConfig
    shard: Shard  # rank 0's part of the model (SINGLE on one rank)
    workers: Workers | None  # ranks 1..N-1 (None on one rank)
    model: MoeCausalLM
    tokenizer: Tokenizer | None  # None: the model folder has none, prompts are token ids
    eos_token_ids: frozenset[int]
    grammars: Grammars | None  # structured outputs need the tokenizer's vocabulary
    slot_pool: SlotPool | None  # the adapter slots on the device (None: LoRA disabled)
    slot_table: SlotTable | None  # which adapter holds which slot
    max_model_len: int  # the model's, or what the KV cache holds if that is less
    pages: PageAllocator
    scheduler: Scheduler
    runner: ModelRunner
    adapters: AdapterRegistry
    # EngineConfig.enable_prefix_caching; off for a hybrid model without state snapshots (a
    # cached prefix must restore its linear layers' recurrent states too)
    prefix_caching: bool = True


def build_engine(cfg: EngineConfig) -> EngineParts:
    """Everything an engine steps with, for `cfg` resolved, on its device made current. The
    other ranks, once started, are stopped again if a later part fails."""
    mc, hf = read_model_config(cfg.model)
    mc = with_quantization(mc, cfg.quantization, cfg.torch_device)
    max_len = requested_max_len(cfg, mc)
    # made before the shard is known: whether these kernels keep MXFP4 or FP8 experts packed
    # decides the model config, which the divisibility check and every other rank build from
    ops = make_rank_ops(cfg, SINGLE, cfg.torch_device)
    if mc.experts_mxfp4 and not ops.keeps_mxfp4:
        mc = replace(mc, experts_mxfp4=False)
    if keeps_fp8_experts(cfg, mc, ops):
        mc = replace(mc, experts_fp8=True)
    if keeps_fp8_projections(cfg, mc, ops):
        mc = replace(mc, projections_fp8=True)
    workers = None
    if cfg.tensor_parallel_size > 1:
        check_divides(mc, cfg.tensor_parallel_size, expert_parallel=cfg.enable_expert_parallel)
        shard, workers = start_workers(cfg, mc, hf, max_len)
        ops = replace(ops, shard=shard)  # the same table, bound to rank 0's part
    try:
        model = load_model(cfg, mc, hf, max_len, ops, cfg.torch_device)
        parts = _around_model(cfg, model, max_len, workers)
    except BaseException:
        if workers is not None:
            workers.close()
        raise
    log.info(
        "engine ready: %s on %s (%s), %d KV pages of %d tokens",
        mc.arch,
        cfg.torch_device,
        cfg.dtype,
        parts.pages.num_pages,
        cfg.page_size,
    )
    return parts


def keeps_fp8_experts(cfg: EngineConfig, mc: ModelConfig, ops: Ops) -> bool:
    """Whether the model holds its block-FP8 experts as codes and scales (ModelConfig.experts_fp8):
    the kernels take them so, one rank holds them all (no shard cuts a block), and w13's gate
    and up rows fit the one grid of scales the fused MoE reads over [2I, H]: I a multiple of
    128, where gate's blocks end before up's begin, or gate and up quantized together (a fused
    checkpoint's gate_up_proj, dummy weights). A per-expert checkpoint with I not a multiple
    of 128 has a block of scales that gate and up would share: dequantized at load instead."""
    if mc.weights_fp8 == "none" or not ops.keeps_fp8 or cfg.tensor_parallel_size > 1:
        return False
    if mc.experts_layout != "gate_up_rows" or not any(mc.sparse_layers):
        return False
    if mc.moe_intermediate_size % FP8_BLOCK[0] == 0 or cfg.load_format == "dummy":
        return True
    return stores_fused_experts(cfg.model)


def keeps_fp8_projections(cfg: EngineConfig, mc: ModelConfig, ops: Ops) -> bool:
    """Whether the model holds attention's block-FP8 projections as codes and scales
    (ModelConfig.projections_fp8: GQA's q/k/v/o, MLA's all but kv_b_proj): the kernels take
    them so, one rank holds them (no shard cuts a block), and each slice of the fused input
    projection but the last ends on a 128-row block (GQA's q and k, MLA's q_a or q_proj), so
    that its grid of scales is the checkpoint's stacked."""
    if mc.weights_fp8 == "none" or not ops.keeps_fp8_projections:
        return False
    if cfg.tensor_parallel_size > 1:
        return False
    if mc.mla is not None:
        return (mc.mla.q_lora_rank or mc.num_heads * mc.mla.qk_head_dim) % FP8_BLOCK[0] == 0
    q_rows = mc.q_size * (2 if mc.attn_output_gate else 1)
    return q_rows % FP8_BLOCK[0] == 0 and mc.kv_size % FP8_BLOCK[0] == 0


def requested_max_len(cfg: EngineConfig, mc: ModelConfig) -> int:
    """max_model_len as asked, at most the model's max_position_embeddings (the default)."""
    if cfg.max_model_len is not None and cfg.max_model_len > mc.max_position_embeddings:
        raise ModelConfigError(
            f"max_model_len={cfg.max_model_len} is invalid: expected at most the model's "
            f"max_position_embeddings={mc.max_position_embeddings}"
        )
    return cfg.max_model_len or mc.max_position_embeddings


def _around_model(
    cfg: EngineConfig, model: MoeCausalLM, max_len: int, workers: Workers | None
) -> EngineParts:
    """The parts around the loaded model, in the order memory asks: the adapter slots before
    the KV cache, which takes what they leave, and the graphs last."""
    mc = model.cfg
    tokenizer, eos = load_tokenizer(cfg.model, mc)
    grammars = Grammars(tokenizer, mc.vocab_size, eos) if tokenizer is not None else None
    pool, table = adapter_slots(cfg, model)
    # hybrid models: one recurrent-state slot per running request and the prefix cache's
    # snapshots, taken before the pages
    num_states, num_snapshots = state_rows(cfg, mc)
    state_bytes = (num_states + num_snapshots) * mc.state_slot_bytes(cfg.torch_dtype)
    num_pages = cfg.num_pages or auto_num_pages(
        cfg, kv_config(mc, model.shard), max_len, reserved=state_bytes
    )
    max_model_len = fitted_max_len(cfg, max_len, num_pages)
    if workers is not None:
        workers.send(num_pages)  # what each worker's KV cache holds too
    pages = PageAllocator(num_pages)
    config = SchedulerConfig(
        cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.page_size, max_model_len=max_model_len
    )
    states = StateSlots(num_states) if num_states else None
    # snapshot rows follow the slots and the spare in the state tensors (layer_states)
    snapshots = StateSnapshots(num_snapshots, num_states + 1) if num_snapshots else None
    if states is not None:
        _log_hybrid(cfg, mc, num_pages, num_snapshots)
    scheduler = Scheduler(config, pages, table, states, snapshots)
    runner = _runner(cfg, model, pool, num_pages, workers, (num_states, num_snapshots))
    # a hybrid model's padded sequences name the spare state slot (state_cache.py: num_states)
    spare_state = num_states if mc.linear_attention is not None else None
    _capture_graphs(cfg, runner, model.ops, max_model_len, num_pages, spare_state)
    adapters = AdapterRegistry(cfg, mc, model.shard, pool)
    for name, path in cfg.lora_modules.items():
        adapters.load(name, path)
    return EngineParts(
        model_config=mc,
        shard=model.shard,
        workers=workers,
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=eos,
        grammars=grammars,
        slot_pool=pool,
        slot_table=table,
        max_model_len=max_model_len,
        pages=pages,
        scheduler=scheduler,
        runner=runner,
        adapters=adapters,
        prefix_caching=cfg.enable_prefix_caching and (states is None or snapshots is not None),
    )


def state_rows(cfg: EngineConfig, mc: ModelConfig) -> tuple[int, int]:
    """A hybrid model's recurrent states: (slots, one per running request; snapshots for its
    prefix cache, max_state_snapshots or max_num_seqs, none when caching is off); (0, 0) for
    other models."""
    if mc.linear_attention is None:
        return 0, 0
    snapshots = cfg.max_num_seqs if cfg.max_state_snapshots is None else cfg.max_state_snapshots
    return cfg.max_num_seqs, snapshots if cfg.enable_prefix_caching else 0


def _log_hybrid(cfg: EngineConfig, mc: ModelConfig, num_pages: int, num_snapshots: int) -> None:
    """How a hybrid model's cache memory divides between recurrent states (running requests'
    and the prefix cache's snapshots) and KV pages."""
    per_state = mc.state_slot_bytes(cfg.torch_dtype)
    log.info(
        "%s: %d recurrent-state slots (max_num_seqs) for %d linear layers take %s; %d KV pages "
        "of %d tokens for %d attention layers take %s",
        mc.arch,
        cfg.max_num_seqs,
        sum(mc.linear_attention.layers),
        _size(cfg.max_num_seqs * per_state),
        num_pages,
        cfg.page_size,
        mc.num_paged_layers,
        _size(num_pages * page_bytes(mc, cfg.page_size, cfg.torch_dtype)),
    )
    if num_snapshots:
        log.info(
            "%s: prefix caching keeps up to %d recurrent-state snapshots at page boundaries "
            "(max_state_snapshots, least recently used evicted), taking %s",
            mc.arch,
            num_snapshots,
            _size(num_snapshots * per_state),
        )
    elif cfg.enable_prefix_caching:
        log.info(
            "%s: prefix caching is off: max_state_snapshots=0 keeps no recurrent-state "
            "snapshot, and a cached prefix must restore the linear layers' states",
            mc.arch,
        )


def adapter_slots(
    cfg: EngineConfig, model: MoeCausalLM
) -> tuple[SlotPool | None, SlotTable | None]:
    """The adapter slots on the device and the table of who holds which (None: LoRA disabled)."""
    if not cfg.enable_lora:
        return None, None
    pool = adapter_pool(cfg, model, cfg.torch_device)
    return pool, SlotTable(
        cfg.max_loras, RegionAllocator(pool.arena.numel()) if pool.compact else None
    )


def adapter_pool(cfg: EngineConfig, model: MoeCausalLM, device: torch.device) -> SlotPool:
    """The adapter arena: compact where every LoRA kernel of the model's table reads it and
    one process holds the model (ranks would each place regions of their own sizes)."""
    compact = model.ops.reads_lora_tables and model.shard.size == 1
    elements = None
    if cfg.max_gpu_lora_gb is not None:
        elements = int(cfg.max_gpu_lora_gb * 2**30) // cfg.torch_dtype.itemsize
    return SlotPool(
        model,
        cfg.max_loras,
        cfg.max_lora_rank,
        dtype=cfg.torch_dtype,
        device=device,
        compact=compact,
        arena_elements=elements,
    )


def load_tokenizer(path: str, mc: ModelConfig) -> tuple[Tokenizer | None, frozenset[int]]:
    """The model folder's tokenizer (None: it has none) and the ids that end a generation."""
    eos = eos_ids_from_folder(path, list(mc.eos_token_ids))
    if not Tokenizer.exists(path):
        return None, frozenset(eos)
    tokenizer = Tokenizer(path, eos)
    return tokenizer, frozenset(tokenizer.eos_token_ids)


def auto_num_pages(cfg: EngineConfig, kv: ModelConfig, max_len: int, *, reserved: int = 0) -> int:
    """KV pages when num_pages is not given: on CUDA what gpu_memory_utilization leaves of the
    GPU (at least one sequence of max_len), on the CPU a fixed budget; either less `reserved`
    bytes (a hybrid model's recurrent states). kv: the model config as this rank's KV cache
    sees it."""
    per_page = max(page_bytes(kv, cfg.page_size, cfg.torch_dtype), 1)  # 0: linear layers only
    per_seq = pages_for(max_len, cfg.page_size)
    if cfg.torch_device.type == "cuda":
        # an engine dropped but not yet collected (its graphs hold cycles) still holds its
        # memory, and the allocator keeps freed blocks: neither is another engine's to count
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(cfg.torch_device)
        budget = int(total * cfg.gpu_memory_utilization) - (total - free) - _GPU_RESERVE
        budget -= reserved
        if budget < per_page * per_seq:
            raise kv_budget_refusal(
                cfg.gpu_memory_utilization, budget, per_page * per_seq, used=total - free
            )
        return budget // per_page
    fit = max((_CPU_KV_BUDGET - reserved) // per_page, 4 * per_seq)
    return min(fit, per_seq * cfg.max_num_seqs)


def kv_budget_refusal(
    utilization: float, budget: int, needed: int, *, used: int | None = None
) -> ModelConfigError:
    """The error of a KV budget (bytes) under the `needed` bytes of one sequence; used: the
    GPU's bytes in use when the budget was taken (this engine's weights, other engines' and
    other processes' memory)."""
    in_use = ""
    if used is not None:
        in_use = (
            f"; {_size(used)} of the GPU were in use (this engine's weights, and any other "
            "engine or process: close() an engine no longer needed, or set num_pages)"
        )
    return ModelConfigError(
        f"gpu_memory_utilization={utilization} leaves {_size(budget)} for the KV cache, "
        f"expected at least {_size(needed)} (one sequence of max_model_len){in_use}"
    )


def _size(nbytes: int) -> str:
    # a tiny model's sequence needs less than 1 MiB: in MiB it would read "at least 0 MiB"
    if abs(nbytes) < 1 << 20:
        return f"{nbytes} bytes"
    return f"{nbytes / (1 << 20):.1f} MiB"


def fitted_max_len(cfg: EngineConfig, max_len: int, num_pages: int) -> int:
    """max_len, or what num_pages hold if that is less (said once here, not first at a
    refused prompt)."""
    fitted = min(max_len, num_pages * cfg.page_size)
    if fitted < max_len:
        log.warning(
            "max_model_len is %d, not %d: the KV cache holds %d pages of %d tokens",
            fitted,
            max_len,
            num_pages,
            cfg.page_size,
        )
    return fitted


def _runner(
    cfg: EngineConfig,
    model: MoeCausalLM,
    pool: SlotPool | None,
    num_pages: int,
    workers: Workers | None,
    states: tuple[int, int] = (0, 0),
) -> ModelRunner:
    """The runner over a KV cache of num_pages pages of this rank's KV heads (and a hybrid
    model's recurrent states: state_rows' slots and snapshots)."""
    kv = allocate_kv_caches(
        kv_config(model.cfg, model.shard),
        num_pages,
        cfg.page_size,
        dtype=cfg.torch_dtype,
        device=cfg.torch_device,
        num_state_slots=states[0],
        num_snapshots=states[1],
    )
    return ModelRunner(model, kv, pool, cfg.page_size, cfg.torch_device, workers)


def _capture_graphs(
    cfg: EngineConfig,
    runner: ModelRunner,
    ops: Ops,
    max_model_len: int,
    num_pages: int,
    spare_state: int | None = None,
) -> None:
    """The runner's CUDA graphs, where they can run: on CUDA, with Triton kernels, on one rank
    (graphs would have to capture the collectives on every rank: not yet, so eager)."""
    if cfg.torch_device.type != "cuda" or cfg.enforce_eager:
        return
    if runner.workers is not None:
        log.warning(
            "tensor_parallel_size=%d runs every step eagerly: CUDA graphs that capture the "
            "collectives are not implemented yet",
            cfg.tensor_parallel_size,
        )
        return
    if ops.name == "torch":
        return
    if runner.model.cfg.mla is not None and cfg.enable_lora and not ops.mla_lora_capturable:
        # the table's kv_b_proj LoRA under absorbed MLA reads the step's slots on the host (the
        # reference), or has not yet been run under a graph on a device (Ops.mla_lora_capturable)
        log.warning(
            "%s with enable_lora runs every step eagerly: kv_b_proj's LoRA under absorbed "
            "MLA is not capturable yet",
            runner.model.cfg.arch,
        )
        return
    from moelora.kernels.attention.paged import DENSE_FROM  # Triton: CUDA only

    runner.capture_graphs(
        max_bs=min(cfg.max_graph_bs, cfg.max_num_seqs),
        max_pages=pages_for(max_model_len, cfg.page_size),
        spare_page=num_pages,
        max_prefill_tokens=min(cfg.max_prefill_graph_tokens, cfg.max_num_batched_tokens),
        max_seqs=cfg.max_num_seqs,
        dense_from=DENSE_FROM if cfg.prefill_attention_backend == "cudnn" else 0,
        concurrent_warmup=cfg.concurrent_warmup,
        spare_state=spare_state,
    )
