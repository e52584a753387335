"""The engine: builds model, caches, adapter slots and scheduler once; then steps.

step(): the scheduler plans, adapters the plan needs are copied into slots, the runner runs
the batch, and each sampled token is appended and checked against the stop conditions.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import numbers
from dataclasses import dataclass

import torch

from moelora.config import EngineConfig
from moelora.engine.kv_cache import PageAllocator, allocate_kv_caches, page_bytes, pages_for
from moelora.engine.request import Request, RequestOutput
from moelora.engine.scheduler import Scheduler, SchedulerConfig
from moelora.errors import (
    AdapterBusyError,
    AdapterExistsError,
    AdapterNotFoundError,
    InvalidRequestError,
    ModelConfigError,
)
from moelora.kernels.ops import make_ops
from moelora.layers.decoder import MoeCausalLM
from moelora.lora.adapter import LoraAdapter, load_adapter
from moelora.lora.slots import SlotPool, SlotTable
from moelora.models.loader import fill_dummy, load_weights
from moelora.models.registry import read_model_config
from moelora.runner.graph_runner import GraphRunner
from moelora.runner.model_runner import ModelRunner
from moelora.sampling import SamplingParams
from moelora.tokenizer import Tokenizer, eos_ids_from_folder

log = logging.getLogger(__name__)

_CPU_KV_BUDGET = 256 << 20  # bytes of KV cache on CPU when num_pages is not given
_GPU_RESERVE = 2 << 30  # bytes kept free on the GPU for activations and graphs


def _is_token(t: object) -> bool:
    """A token id: an integer (numpy's integers too), not a bool."""
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    lora_slots_used: int
    lora_slots_total: int
    graph_replays: int
    eager_steps: int


class Engine:
    def __init__(self, config: EngineConfig):
        cfg = config.resolved()
        self.config = cfg
        # the current CUDA device is per thread and graph capture, its memory pool and every
        # Triton launch follow it, not the tensors: on cuda:1 they must all run under it
        with self.on_device():
            self._build(cfg)

    def _build(self, cfg: EngineConfig) -> None:
        device, dtype = cfg.torch_device, cfg.torch_dtype
        self.model_config, hf = read_model_config(cfg.model)
        mc = self.model_config
        if cfg.max_model_len is not None and cfg.max_model_len > mc.max_position_embeddings:
            raise ModelConfigError(
                f"max_model_len={cfg.max_model_len} is invalid: expected at most the model's "
                f"max_position_embeddings={mc.max_position_embeddings}"
            )
        max_len = cfg.max_model_len or mc.max_position_embeddings
        ops = make_ops(
            device,
            force_reference=cfg.force_reference_kernels,
            projections=cfg.projections,
        )
        self.model = MoeCausalLM(mc, hf, max_len, ops, dtype=dtype, device=device)
        with torch.no_grad():
            if cfg.load_format == "dummy":
                fill_dummy(self.model, cfg.seed)
            else:
                load_weights(self.model, cfg.model)
        self.tokenizer = None
        eos = eos_ids_from_folder(cfg.model, list(mc.eos_token_ids))
        if Tokenizer.exists(cfg.model):
            self.tokenizer = Tokenizer(cfg.model, eos)
            eos = self.tokenizer.eos_token_ids
        self.eos_token_ids = frozenset(eos)
        self.slot_pool = self.slot_table = None
        if cfg.enable_lora:
            self.slot_pool = SlotPool(
                self.model, cfg.max_loras, cfg.max_lora_rank, dtype=dtype, device=device
            )
            self.slot_table = SlotTable(cfg.max_loras)
        num_pages = cfg.num_pages or self._auto_num_pages(max_len)
        self.max_model_len = min(max_len, num_pages * cfg.page_size)
        if self.max_model_len < max_len:  # said once here, not first at a refused prompt
            log.warning(
                "max_model_len is %d, not %d: the KV cache holds %d pages of %d tokens",
                self.max_model_len,
                max_len,
                num_pages,
                cfg.page_size,
            )
        kv = allocate_kv_caches(mc, num_pages, cfg.page_size, dtype=dtype, device=device)
        self.pages = PageAllocator(num_pages)
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.page_size),
            self.pages,
            self.slot_table,
        )
        self.runner = ModelRunner(self.model, kv, self.slot_pool, cfg.page_size, device)
        if device.type == "cuda" and not cfg.enforce_eager and ops.name != "torch":
            self.runner.graphs = GraphRunner(
                self.model,
                kv,
                self.slot_pool,
                max_bs=min(cfg.max_graph_bs, cfg.max_num_seqs),
                max_pages=pages_for(self.max_model_len, cfg.page_size),
                spare_page=num_pages,
                device=device,
            )
            self.runner.graphs.capture()
        self.adapters: dict[str, LoraAdapter] = {}
        self._requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._seed_source = torch.Generator().manual_seed(cfg.seed)  # per-request seeds
        for name, path in cfg.lora_modules.items():
            self.load_lora(name, path)
        log.info(
            "engine ready: %s on %s (%s), %d KV pages of %d tokens",
            mc.arch,
            device,
            cfg.dtype,
            num_pages,
            cfg.page_size,
        )

    def on_device(self) -> contextlib.AbstractContextManager:
        """The engine's CUDA device made current (for this thread) while the block runs."""
        device = self.config.torch_device
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

    @property
    def model_name(self) -> str:
        return self.config.model_name

    def _auto_num_pages(self, max_len: int) -> int:
        cfg = self.config
        per_page = page_bytes(self.model_config, cfg.page_size, cfg.torch_dtype)
        per_seq = pages_for(max_len, cfg.page_size)
        if cfg.torch_device.type == "cuda":
            free, total = torch.cuda.mem_get_info(cfg.torch_device)
            budget = int(total * cfg.gpu_memory_utilization) - (total - free) - _GPU_RESERVE
            if budget < per_page * per_seq:
                raise ModelConfigError(
                    f"gpu_memory_utilization={cfg.gpu_memory_utilization} leaves "
                    f"{budget >> 20} MiB for the KV cache, expected at least "
                    f"{(per_page * per_seq) >> 20} MiB (one sequence of max_model_len)"
                )
            return budget // per_page
        fit = max(_CPU_KV_BUDGET // per_page, 4 * per_seq)
        return min(fit, per_seq * cfg.max_num_seqs)

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lora: str | None = None,
    ) -> None:
        if request_id in self._requests:
            raise InvalidRequestError(f"request_id={request_id!r} is already in use")
        if params.stop:
            self.text_tokenizer("stop strings")  # matched on the decoded text
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty: expected at least one token")
        if n > self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens, expected at most max_model_len={self.max_model_len}"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not (_is_token(t) and 0 <= t < vocab)]
        if bad:
            raise InvalidRequestError(
                f"prompt token id {bad[0]!r} is invalid: expected an integer in [0, {vocab})"
            )
        bad = [t for t in params.logit_bias or {} if t >= vocab]
        if bad:
            raise InvalidRequestError(
                f"logit_bias token id {bad[0]} is invalid: expected 0 <= id < {vocab}"
            )
        if params.prompt_logprobs is not None and params.prompt_logprobs > vocab:
            raise InvalidRequestError(
                f"prompt_logprobs={params.prompt_logprobs} is invalid: expected at most the "
                f"vocabulary size {vocab}"
            )
        if params.logprobs is not None and params.logprobs > vocab:
            raise InvalidRequestError(
                f"logprobs={params.logprobs} is invalid: expected at most the vocabulary size "
                f"{vocab}"
            )
        if lora is not None and lora not in self.adapters:
            raise AdapterNotFoundError(
                f"adapter {lora!r} is not loaded: expected one of {sorted(self.adapters)}"
            )
        gen = None
        if params.temperature > 0:
            seed = params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
            gen = torch.Generator(device=self.config.torch_device).manual_seed(seed)
        prompt = [int(t) for t in prompt_token_ids]
        req = Request(request_id, prompt, params, lora, next(self._arrivals), gen)
        self._requests[request_id] = req
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        with self.on_device():
            return self._step()

    def _step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return []
        for slot, name in plan.lora_loads:
            self.slot_pool.fill(slot, self.adapters[name])
        step = self.runner.execute(plan)
        outputs = []
        for i, chunk in enumerate(plan.chunks):
            chunk.request.num_computed_tokens += chunk.num_tokens
            chunk.request.prompt_logprobs += step.prompt_logprobs.get(i, [])
        for chunk, result in zip((c for c in plan.chunks if c.samples), step.samples):
            req = chunk.request
            req.output_token_ids.append(result.token_id)
            if result.logprobs is not None:
                req.output_logprobs.append(result.logprobs)
            reason = self._finish_reason(req, result.token_id)
            if reason is not None:
                self.scheduler.finish(req, reason)
                self._requests.pop(req.request_id, None)
            outputs.append(req.to_output())
        return outputs

    def text_tokenizer(self, needed_for: str) -> Tokenizer:
        """The tokenizer, or an InvalidRequestError saying the model folder has none."""
        if self.tokenizer is None:
            raise InvalidRequestError(
                f"{needed_for} need a tokenizer and this model folder has none: give prompts "
                "as token id lists and stops as stop_token_ids"
            )
        return self.tokenizer

    def _finish_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if self.tokenizer is not None:
            seen = len(req.text)
            delta, req.detok_offsets = self.tokenizer.decode_incremental(
                req.output_token_ids, req.detok_offsets
            )
            req.text += delta
            for stop in p.stop or []:  # only where the new text can complete a match
                cut = req.text.find(stop, max(0, seen - len(stop) + 1))
                if cut >= 0:
                    req.text = req.text[:cut]
                    return "stop"
        if (not p.ignore_eos and token in self.eos_token_ids) or token in (p.stop_token_ids or []):
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    # ---- adapters -------------------------------------------------------------------------

    def load_lora(self, name: str, path: str) -> None:
        if self.slot_pool is None:
            raise InvalidRequestError("LoRA is disabled in this engine (enable_lora=False)")
        if name in self.adapters or name == self.model_name:
            raise AdapterExistsError(f"an adapter or model named {name!r} is already loaded")
        adapter = load_adapter(
            name,
            path,
            self.slot_pool.targets,
            max_rank=self.config.max_lora_rank,
            dtype=self.config.torch_dtype,
        )
        self.adapters[name] = adapter  # slots are filled on demand, when a request needs it

    def unload_lora(self, name: str) -> None:
        if name not in self.adapters:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
        if self.scheduler.uses_adapter(name):
            raise AdapterBusyError(
                f"adapter {name!r} has requests in flight: unload it once they finish"
            )
        slot = self.slot_table.evict(name)
        if slot is not None:
            self.slot_pool.clear(slot)
        del self.adapters[name]

    def list_loras(self) -> list[str]:
        return list(self.adapters)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_pages_used=self.pages.num_used,
            kv_pages_total=self.pages.num_pages,
            lora_slots_used=self.slot_table.num_used if self.slot_table else 0,
            lora_slots_total=self.config.max_loras if self.slot_table else 0,
            graph_replays=self.runner.num_graph_replays,
            eager_steps=self.runner.num_eager_steps,
        )
