"""The ranks of one host: how each builds its part of the model, and how rank 0 (the engine's
own process) starts ranks 1..N-1 with torch.multiprocessing and joins them in one
torch.distributed group (NCCL on CUDA, gloo on the CPU) built on a TCPStore it serves: no
launcher, and no default process group, so several engines may live in one process.

Workers come from a fork server (a fresh interpreter, never a fork of rank 0, so no CUDA
context or thread is inherited) that has imported torch and moelora once: a worker then starts
without importing them again, where spawn would import everything for each. A script that
builds a multi-rank engine needs the `if __name__ == "__main__":` guard, as with spawn.

A worker builds what rank 0 builds, minus the scheduler, the tokenizer and the sampler, then
runs rank 0's commands (runner/tp.py). Workers are daemons: they die with rank 0's interpreter
at the latest, and end on their own when rank 0's pipe closes.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from moelora.config import EngineConfig, ModelConfig
from moelora.engine.kv_cache import allocate_kv_caches
from moelora.errors import EngineDeadError
from moelora.kernels.ops import Ops, make_ops
from moelora.lora.slots import SlotPool
from moelora.models.loader import fill_dummy, load_weights, settle
from moelora.models.model import MoeCausalLM
from moelora.models.shard import load_shard
from moelora.parallel import Shard
from moelora.runner.model_runner import ModelRunner
from moelora.runner.tp import Workers, serve

# every collective and the ranks' rendezvous: a rank that stops answering fails the engine
# after this long instead of hanging it (a dead process is caught at once, before a collective)
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


# not fork: the workers must not inherit rank 0's threads or CUDA context
START_METHOD = "forkserver"


@dataclass(frozen=True)
class RankSpec:
    """What a worker builds its rank from."""

    config: EngineConfig  # resolved
    model_config: ModelConfig  # as rank 0 resolved it
    hf_config: Any  # the HF config, for rotary (read once, by rank 0)
    max_len: int
    port: int  # of rank 0's TCPStore


def device_of(cfg: EngineConfig, rank: int) -> torch.device:
    """Rank r's device: the engine's CUDA device plus r, or the CPU."""
    device = cfg.torch_device
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def make_rank_ops(cfg: EngineConfig, shard: Shard, device: torch.device) -> Ops:
    return make_ops(
        device,
        force_reference=cfg.force_reference_kernels,
        projections=cfg.projections,
        prefill_attention_backend=cfg.prefill_attention_backend,
        deterministic=cfg.enable_deterministic_inference,
        mla_expanded_prefill=cfg.mla_prefill == "expanded",
        chunked_delta_rule=cfg.linear_attention_prefill == "chunked",
        shard=shard,
    )


def load_model(
    cfg: EngineConfig, mc: ModelConfig, hf_config, max_len: int, ops: Ops, device: torch.device
) -> MoeCausalLM:
    """This rank's model with its weights. Several ranks: each reads the checkpoint and keeps
    its part of every parameter (models/shard.py); dummy weights are each rank's own draw."""
    model = MoeCausalLM(mc, hf_config, max_len, ops, dtype=cfg.torch_dtype, device=device)
    with torch.no_grad():
        if cfg.load_format == "dummy":
            fill_dummy(model, cfg.seed)
        elif ops.shard.size == 1:
            load_weights(model, cfg.model)
        else:
            meta = torch.device("meta")
            whole = MoeCausalLM(
                mc, hf_config, max_len, make_ops(meta), dtype=cfg.torch_dtype, device=meta
            )
            load_shard(model, whole, cfg.model, ops.shard)
        settle(model)
    return model


def kv_config(mc: ModelConfig, shard: Shard) -> ModelConfig:
    """The model config as this rank's KV cache sees it: its KV heads only."""
    return dataclasses.replace(mc, num_kv_heads=shard.kv_heads(mc.num_kv_heads))


def start_workers(
    cfg: EngineConfig, mc: ModelConfig, hf_config: Any, max_len: int
) -> tuple[Shard, Workers]:
    """Ranks 1..N-1 started, and rank 0's shard once all N have joined the group."""
    size = cfg.tensor_parallel_size
    store = torch.distributed.TCPStore(
        "127.0.0.1", 0, size, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False
    )
    ctx = torch.multiprocessing.get_context(START_METHOD)
    # what a worker imports, the fork server imports once (it starts with the first engine's
    # workers): moelora, rotary's transformers module, and the HF config's class, which
    # unpickling a RankSpec imports (each a slow import)
    preload = ["moelora.engine.ranks", "transformers.modeling_rope_utils"]
    ctx.set_forkserver_preload(preload + [type(hf_config).__module__])
    processes, pipes = [], []
    for rank in range(1, size):
        ours, theirs = ctx.Pipe()
        spec = RankSpec(cfg, mc, hf_config, max_len, store.port)
        p = ctx.Process(
            target=_worker_main, args=(spec, rank, theirs), daemon=True, name=f"moelora-rank{rank}"
        )
        p.start()
        theirs.close()  # the worker's end: once it exits, our reads see the pipe closed
        processes.append(p)
        pipes.append(ours)
    workers = Workers(processes, pipes, keep=store)
    try:
        _wait_for_workers(store, workers)
        return join_group(cfg, 0, store), workers
    except (RuntimeError, EngineDeadError) as e:
        workers.close()
        raise EngineDeadError(f"the tensor-parallel ranks did not all start: {e}") from e


def _wait_for_workers(store: Any, workers: Workers) -> None:
    """Until every worker has reached the store; a worker that dies first (an import error, a
    script without its `if __name__ == "__main__":` guard) fails at once, not after the
    rendezvous times out."""
    keys = [f"up/{rank}" for rank in range(1, len(workers.processes) + 1)]
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
    while not store.check(keys):
        workers.check()
        if time.monotonic() > deadline:
            raise EngineDeadError(f"a worker did not start within {COLLECTIVE_TIMEOUT}")
        time.sleep(0.02)


def join_group(cfg: EngineConfig, rank: int, store: Any) -> Shard:
    """This rank's Shard, in the group of all ranks (blocks until every rank has joined)."""
    size = cfg.tensor_parallel_size
    prefixed = torch.distributed.PrefixStore("moelora", store)
    if device_of(cfg, rank).type == "cuda":
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = COLLECTIVE_TIMEOUT
        group = torch.distributed.ProcessGroupNCCL(prefixed, rank, size, options)
    else:
        group = torch.distributed.ProcessGroupGloo(prefixed, rank, size, COLLECTIVE_TIMEOUT)
    return Shard(rank, size, cfg.enable_expert_parallel, group)


def _worker_main(spec: RankSpec, rank: int, pipe: Any) -> None:
    cfg = spec.config
    device = device_of(cfg, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the host's cores shared among the ranks, not each rank taking them all
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.tensor_parallel_size))
    store = torch.distributed.TCPStore(
        "127.0.0.1",
        spec.port,
        cfg.tensor_parallel_size,
        is_master=False,
        timeout=COLLECTIVE_TIMEOUT,
    )
    store.set(f"up/{rank}", "1")
    shard = join_group(cfg, rank, store)
    serve(_build_worker(spec, shard, device, pipe), pipe)
    # nothing of a worker outlives it: skip torch's slow teardown at exit
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _build_worker(spec: RankSpec, shard: Shard, device: torch.device, pipe: Any) -> ModelRunner:
    cfg, mc = spec.config, spec.model_config
    model = load_model(
        cfg, mc, spec.hf_config, spec.max_len, make_rank_ops(cfg, shard, device), device
    )
    num_pages = pickle.loads(pipe.recv_bytes())  # rank 0's count: every rank holds as many
    kv = allocate_kv_caches(
        kv_config(mc, shard), num_pages, cfg.page_size, dtype=cfg.torch_dtype, device=device
    )
    pool = None
    if cfg.enable_lora:
        pool = SlotPool(
            model,
            cfg.max_loras,
            cfg.max_lora_rank,
            dtype=cfg.torch_dtype,
            device=device,
            compact=False,  # several ranks: the old layout (build.adapter_pool says why)
        )
    return ModelRunner(model, kv, pool, cfg.page_size, device)
