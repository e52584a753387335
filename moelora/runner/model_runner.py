"""The runner executes a StepPlan: builds the ForwardBatch, runs the model, samples.

Eager path here; decode batches that fit a captured graph go through the GraphRunner.
"""

from __future__ import annotations

import torch

from moelora.engine.kv_cache import pages_for
from moelora.engine.scheduler import StepPlan
from moelora.lora.batch_info import NO_SLOT, LoraBatchInfo
from moelora.lora.slots import SlotPool
from moelora.runner.batch import AttentionMetadata, ForwardBatch
from moelora.sampling import SampleResult, sample


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list,
        slot_pool: SlotPool | None,
        page_size: int,
        device: torch.device,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.slot_pool = slot_pool
        self.page_size = page_size
        self.device = device
        self.graphs = None  # a GraphRunner, when graphs are enabled
        self.num_graph_replays = 0
        self.num_eager_steps = 0

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[SampleResult]:
        """One forward over every chunk; a sample for each chunk that reaches its last token."""
        batch = self.build_batch(plan)
        if self.graphs is not None and self.graphs.can_run(batch):
            hidden = self.graphs.run(batch)
            self.num_graph_replays += 1
        else:
            hidden = self.model(batch, self.kv_caches)
            self.num_eager_steps += 1
        sampling = [i for i, c in enumerate(plan.chunks) if c.samples]
        if not sampling:
            return []
        last_rows = batch.attn.cu_seqlens_q[1:][sampling].long() - 1
        logits = self.model.compute_logits(hidden[last_rows])
        reqs = [plan.chunks[i].request for i in sampling]
        return sample(logits, [r.params for r in reqs], [r.generator for r in reqs])

    def build_batch(self, plan: StepPlan) -> ForwardBatch:
        ids, positions, slot_mapping, slots, q_lens, seq_lens = [], [], [], [], [], []
        ps = self.page_size
        for c in plan.chunks:
            req = c.request
            stop = c.start + c.num_tokens
            ids += req.token_slice(c.start, stop)
            pos = range(c.start, stop)
            positions += pos
            slot_mapping += [req.pages[p // ps] * ps + p % ps for p in pos]
            slots += [NO_SLOT if req.slot is None else req.slot] * c.num_tokens
            q_lens.append(c.num_tokens)
            seq_lens.append(stop)
        max_pages = max(pages_for(s, ps) for s in seq_lens)
        table = [
            c.request.pages[:max_pages] + [0] * (max_pages - len(c.request.pages[:max_pages]))
            for c in plan.chunks
        ]
        cu = [0]
        for q in q_lens:
            cu.append(cu[-1] + q)
        dev = self.device

        def t(x, dtype):
            return torch.tensor(x, dtype=dtype, device=dev)

        attn = AttentionMetadata(
            cu_seqlens_q=t(cu, torch.int32),
            seq_lens=t(seq_lens, torch.int32),
            page_table=t(table, torch.int32),
            slot_mapping=t(slot_mapping, torch.int64),
            max_query_len=max(q_lens),
        )
        return ForwardBatch(
            t(ids, torch.int64), t(positions, torch.int64), attn, self._lora_info(slots)
        )

    def _lora_info(self, slots: list[int]) -> LoraBatchInfo | None:
        pool = self.slot_pool
        if pool is None:
            return None
        enabled = [0] * pool.max_loras
        for s in set(slots) - {NO_SLOT}:
            enabled[s] = int(pool.host_rank[s] > 0)
        return LoraBatchInfo(
            slot_of_token=torch.tensor(slots, dtype=torch.int32, device=self.device),
            rank_of_slot=pool.rank_of_slot,
            scaling_of_slot=pool.scaling_of_slot,
            slot_enabled=torch.tensor(enabled, dtype=torch.int32, device=self.device),
        )
