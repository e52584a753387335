"""The static graph inputs on CPU: a batch is written in place and the rest becomes padding."""

import dataclasses

import torch

from moelora.runner.graph_runner import GraphBuffers
from moelora.step.batch import HostBatch
from moelora.step.lora import NO_SLOT


def host_batch(T: int, width: int) -> HostBatch:
    g = torch.Generator().manual_seed(T)
    return HostBatch(
        input_ids=torch.randint(0, 100, (T,), generator=g),
        positions=torch.randint(0, 50, (T,), generator=g),
        slot_mapping=torch.randint(0, 400, (T,), generator=g),
        cu_seqlens_q=torch.arange(T + 1, dtype=torch.int32),
        seq_lens=torch.randint(1, 50, (T,), generator=g, dtype=torch.int32),
        page_table=torch.randint(0, 30, (T, width), generator=g, dtype=torch.int32),
        slot_of_token=torch.randint(-1, 4, (T,), generator=g, dtype=torch.int32),
        slot_enabled=torch.tensor([1, 0, 1, 1], dtype=torch.int32),
        max_query_len=1,
    )


def test_copy_from_writes_rows_and_pads_the_rest():
    buffers = GraphBuffers.init(
        max_tokens=16, max_pages=8, max_loras=4, spare_page=99, device="cpu"
    )
    big, small = host_batch(11, 5), host_batch(3, 2)
    buffers.copy_from(big)
    buffers.copy_from(small)  # a smaller batch after a larger one leaves no stale rows
    fb = buffers.forward_batch(8, pool=None)
    assert torch.equal(fb.input_ids[:3], small.input_ids)
    assert torch.equal(fb.positions[:3], small.positions)
    assert torch.equal(fb.attn.slot_mapping[:3], small.slot_mapping)
    assert (fb.attn.slot_mapping[3:] == -1).all()
    assert fb.attn.cu_seqlens_q.tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3]
    assert fb.attn.seq_lens[3:].eq(0).all() and torch.equal(fb.attn.seq_lens[:3], small.seq_lens)
    assert torch.equal(fb.attn.page_table[:3, :2], small.page_table)
    assert (fb.attn.page_table[3:] == 99).all()
    views = buffers._views(buffers.i64, buffers.i32)
    assert torch.equal(views["slot_of_token"][:3], small.slot_of_token)
    assert (views["slot_of_token"][3:] == NO_SLOT).all()
    assert views["slot_enabled"].tolist() == [1, 0, 1, 1]


def test_any_enabled_follows_the_batch():
    """The step's "any slot enabled" flag, which the MoE GEMMs test before their LoRA epilogue:
    set by a batch with an enabled slot, cleared by a base-only batch written after it; the
    eager path's batch info carries the same flag."""
    buffers = GraphBuffers.init(
        max_tokens=16, max_pages=8, max_loras=4, spare_page=99, device="cpu"
    )
    lora, base = host_batch(5, 3), host_batch(6, 3)
    base.slot_of_token.fill_(NO_SLOT)
    base.slot_enabled.zero_()
    views = buffers._views(buffers.i64, buffers.i32)
    for batch, expect in [(lora, 1), (base, 0), (lora, 1)]:
        buffers.copy_from(batch)
        assert views["any_enabled"].tolist() == [expect]
        pool = type("Pool", (), {"rank_of_slot": torch.ones(4), "scaling_of_slot": torch.ones(4)})
        assert batch.to_device(torch.device("cpu"), pool).lora.any_enabled.tolist() == [expect]
        graph_info = buffers.forward_batch(8, pool).lora  # what a captured graph reads
        assert graph_info.any_enabled.data_ptr() == views["any_enabled"].data_ptr()


def test_a_hybrid_models_state_slots_are_written_and_padded_with_the_spare():
    """A hybrid model's steps carry each sequence's recurrent-state slot: the batch's come
    first, the padded sequences name the spare slot (their kernels touch no state), and a
    smaller batch after a larger one leaves none of its slots behind."""
    buffers = GraphBuffers.init(
        max_tokens=16, max_pages=8, max_loras=4, spare_page=99, device="cpu", spare_state=7
    )
    assert buffers.forward_batch(8, pool=None).attn.state_slots.tolist() == [7] * 8
    big = dataclasses.replace(host_batch(11, 5), state_slots=torch.arange(11).int() % 7)
    small = dataclasses.replace(host_batch(3, 2), state_slots=torch.tensor([4, 0, 2]).int())
    buffers.copy_from(big)
    buffers.copy_from(small)
    fb = buffers.forward_batch(8, pool=None)
    assert fb.attn.state_slots.tolist() == [4, 0, 2] + [7] * 5
    assert fb.attn.page_table[3:].eq(99).all()  # the other parts are where they were
    assert torch.equal(fb.attn.seq_lens[:3], small.seq_lens)
    plain = GraphBuffers.init(max_tokens=16, max_pages=8, max_loras=4, spare_page=99, device="cpu")
    assert plain.forward_batch(8, pool=None).attn.state_slots is None
