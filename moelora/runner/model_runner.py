"""The runner executes a StepPlan: lays the batch out on the host, runs the model (a captured
graph for decode batches that fit one, eager otherwise), and samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora.engine.kv_cache import pages_for
from moelora.engine.scheduler import StepPlan
from moelora.lora.batch_info import NO_SLOT, LoraBatchInfo
from moelora.lora.slots import SlotPool
from moelora.runner.batch import AttentionMetadata, ForwardBatch
from moelora.sampling import SampleResult, sample, token_logprobs

PROMPT_LOGITS_ROWS = 512  # prompt positions whose logits are computed at once


@dataclass(frozen=True)
class StepOutput:
    samples: list[SampleResult]  # one per chunk that samples, in chunk order
    prompt_logprobs: dict[int, list[dict[int, float]]]  # chunk index -> its new entries


@dataclass(frozen=True)
class HostBatch:
    """One step's inputs as host tensors; T = tokens, B = sequences, P = pages per sequence."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    page_table: torch.Tensor  # [B, P] int32
    slot_of_token: torch.Tensor  # [T] int32
    slot_enabled: torch.Tensor | None  # [S] int32; None when LoRA is disabled
    max_query_len: int

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def to_device(self, device: torch.device, pool: SlotPool | None) -> ForwardBatch:
        def dev(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        attn = AttentionMetadata(
            dev(self.cu_seqlens_q),
            dev(self.seq_lens),
            dev(self.page_table),
            dev(self.slot_mapping),
            self.max_query_len,
        )
        lora = None
        if pool is not None:
            lora = LoraBatchInfo(
                dev(self.slot_of_token),
                pool.rank_of_slot,
                pool.scaling_of_slot,
                dev(self.slot_enabled),
            )
        return ForwardBatch(dev(self.input_ids), dev(self.positions), attn, lora)


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
    def execute(self, plan: StepPlan) -> StepOutput:
        """One forward over every chunk: a sample for each chunk that reaches its last token,
        and prompt logprobs for the chunks of requests that ask for them."""
        host = self.host_batch(plan)
        if self.graphs is not None and self.graphs.can_run(host):
            hidden = self.graphs.run(host)
            self.num_graph_replays += 1
        else:
            hidden = self.model(host.to_device(self.device, self.slot_pool), self.kv_caches)
            self.num_eager_steps += 1
        prompt_logprobs = self._prompt_logprobs(plan, host, hidden)
        sampling = [i for i, c in enumerate(plan.chunks) if c.samples]
        if not sampling:
            return StepOutput([], prompt_logprobs)
        last_rows = (host.cu_seqlens_q[1:][sampling] - 1).to(self.device, non_blocking=True)
        logits = self.model.compute_logits(hidden[last_rows])
        reqs = [plan.chunks[i].request for i in sampling]
        params = [r.params for r in reqs]
        history = (
            [(r.prompt_token_ids, r.output_token_ids) for r in reqs]
            if any(p.adjusts_logits for p in params)
            else None
        )
        samples = sample(logits, params, [r.generator for r in reqs], history)
        return StepOutput(samples, prompt_logprobs)

    def _prompt_logprobs(
        self, plan: StepPlan, host: HostBatch, hidden: torch.Tensor
    ) -> dict[int, list[dict[int, float]]]:
        """{chunk index: entries} for the prompt tokens this step's rows predict (row p of a
        sequence predicts token p + 1), for requests with prompt_logprobs set. Positions a
        preempted request already reported are skipped; logits go PROMPT_LOGITS_ROWS rows at a
        time, so a long prompt does not hold [tokens, vocab] floats at once."""
        found = {}
        for i, c in enumerate(plan.chunks):
            req = c.request
            top = req.params.prompt_logprobs
            if top is None:
                continue
            first = max(c.start, len(req.prompt_logprobs))  # position predicting token first+1
            last = min(c.start + c.num_tokens, len(req.prompt_token_ids) - 1)
            if first >= last:
                continue
            row0 = int(host.cu_seqlens_q[i]) + first - c.start
            targets = torch.tensor(req.prompt_token_ids[first + 1 : last + 1], device=self.device)
            entries = []
            for r in range(0, last - first, PROMPT_LOGITS_ROWS):
                rows = slice(row0 + r, row0 + min(r + PROMPT_LOGITS_ROWS, last - first))
                logprobs = self.model.compute_logits(hidden[rows]).log_softmax(dim=-1)
                entries += token_logprobs(logprobs, targets[r : r + PROMPT_LOGITS_ROWS], top)
            found[i] = entries
        return found

    def host_batch(self, plan: StepPlan) -> HostBatch:
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
        width = max(pages_for(s, ps) for s in seq_lens)
        table = torch.zeros(len(plan.chunks), width, dtype=torch.int32)
        for b, c in enumerate(plan.chunks):
            used = c.request.pages[: pages_for(seq_lens[b], ps)]
            table[b, : len(used)] = torch.tensor(used, dtype=torch.int32)
        cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(q_lens).cumsum(0)
        return HostBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
            cu_seqlens_q=cu,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            page_table=table,
            slot_of_token=torch.tensor(slots, dtype=torch.int32),
            slot_enabled=self._slot_enabled(slots),
            max_query_len=max(q_lens),
        )

    def _slot_enabled(self, slots: list[int]) -> torch.Tensor | None:
        pool = self.slot_pool
        if pool is None:
            return None
        enabled = torch.zeros(pool.max_loras, dtype=torch.int32)
        for s in set(slots) - {NO_SLOT}:
            enabled[s] = int(pool.host_rank[s] > 0)  # an empty slot does no work
        return enabled
