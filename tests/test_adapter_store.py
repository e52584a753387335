"""The adapter store (issue 41, item 2): folders checked at registration from their headers
alone, read on first use by one worker thread, kept in host memory under count and byte bounds
with least-recently-used eviction; held and in-memory adapters are never evicted.

Every wait is on the store's own completion signal, with a timeout: nothing sleeps and hopes.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import hf_fixtures as hf
import pytest
import torch
from test_adapter_refusals import ARCH, CASES, MAX_LORA_RANK, Case

from moelora.errors import AdapterError
from moelora.lora import adapter as adapter_module
from moelora.lora import store as store_module
from moelora.lora.adapter import LoraAdapter, load_adapter, random_adapter
from moelora.lora.slots import LoraTarget
from moelora.lora.store import AdapterStore

if TYPE_CHECKING:
    from conftest import FixtureBank

TIMEOUT = 60.0  # seconds: a bound on waits that end in milliseconds, never a pace
P = hf.PEFT_PREFIX + "model.layers.0"
E, H, Q, KV, I = 4, 32, 32, 16, 12  # experts, hidden, q size, kv size, expert intermediate
MAX_RANK = 16


def _targets() -> dict[str, LoraTarget]:
    """One MoE layer with attention."""
    return {
        "layers.0.qkv": LoraTarget("layers.0.qkv", H, (Q, KV, KV), 0, None, ""),
        "layers.0.experts13": LoraTarget("layers.0.experts13", H, (I, I), E, None, ""),
        "layers.0.experts2": LoraTarget("layers.0.experts2", I, (H,), E, None, ""),
    }


def _write_peft(path: Path, *, rank: int, seed: int, fmt: str = "safetensors") -> str:
    """A random PEFT folder: q and v, and every expert's gate, up and down."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"self_attn.q_proj": (H, Q), "self_attn.v_proj": (H, KV)}
    for e in range(E):
        shapes |= {f"mlp.experts.{e}.{p}_proj": (H, I) for p in ("gate", "up")}
        shapes[f"mlp.experts.{e}.down_proj"] = (I, H)
    tensors = {}
    for module, (fan_in, fan_out) in shapes.items():
        tensors[f"{P}.{module}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen)
        tensors[f"{P}.{module}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}
    hf.write_adapter(path, config, tensors)
    if fmt == "bin":
        (path / "adapter_model.safetensors").unlink()
        torch.save(tensors, path / "adapter_model.bin")
    return str(path)


def _store(**kwargs) -> AdapterStore:
    return AdapterStore(_targets(), max_rank=MAX_RANK, dtype=torch.float32, pin=False, **kwargs)


@pytest.fixture
def make_store():
    """Stores closed (their worker joined) at the end of the test, whatever happens."""
    stores = []

    def make(**kwargs) -> AdapterStore:
        stores.append(_store(**kwargs))
        return stores[-1]

    yield make
    for store in stores:
        store.close()


def _load(path: str, name: str = "a") -> LoraAdapter:
    return load_adapter(name, path, _targets(), max_rank=MAX_RANK, dtype=torch.float32)


def _wait(store: AdapterStore, *loads: int) -> None:
    """Until the reads of `loads` have ended (all of them, and nothing else)."""
    deadline, seen = time.monotonic() + TIMEOUT, []
    while set(seen) < set(loads) and time.monotonic() < deadline:
        seen += store.completed(timeout=deadline - time.monotonic())
    assert sorted(seen) == sorted(loads)


def _read(store: AdapterStore, load: int) -> LoraAdapter:
    assert store.get(load) is None
    _wait(store, load)
    adapter = store.get(load)
    assert adapter is not None
    return adapter


def assert_same(got: LoraAdapter, want: LoraAdapter) -> None:
    assert (got.name, got.path, got.rank, got.scaling) == (
        want.name,
        want.path,
        want.rank,
        want.scaling,
    )
    assert got.modules.keys() == want.modules.keys()
    for key, m in want.modules.items():
        assert torch.equal(got.modules[key].a, m.a), key
        assert torch.equal(got.modules[key].b, m.b), key


class Gate:
    """load_adapter behind a gate: full reads (not header checks) of folders under `root` are
    counted and wait until the test opens it; any other store's reads pass through."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
        self.root = str(root)
        self.reads = 0
        self.started, self.opened = threading.Event(), threading.Event()
        self.thread: threading.Thread | None = None  # the one a full read last ran on
        monkeypatch.setattr(store_module, "load_adapter", self._load)

    def _load(self, name: str, path: str, *args, meta: bool = False, **kwargs) -> LoraAdapter:
        if not meta and path.startswith(self.root):
            self.reads += 1
            self.thread = threading.current_thread()
            self.started.set()
            assert self.opened.wait(TIMEOUT)
        return load_adapter(name, path, *args, meta=meta, **kwargs)


# ---- registration ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_registration_reads_no_tensor_data(tmp_path, make_store, monkeypatch, fmt) -> None:
    path = _write_peft(tmp_path / "a", rank=4, seed=1, fmt=fmt)
    want = _load(path)
    torch_load = torch.load

    def refuse_data(*args, **kwargs):
        raise AssertionError("tensor data read at registration")

    def meta_only(*args, map_location=None, **kwargs):
        assert map_location == "meta", "tensor data read at registration"
        return torch_load(*args, map_location=map_location, **kwargs)

    with monkeypatch.context() as m:
        m.setattr("safetensors.torch.load_file", refuse_data)
        m.setattr(adapter_module.torch, "load", meta_only)
        store = make_store()
        store.add_folder(7, "a", path)
    assert store.state(7) == "disk"
    layout = store.layout(7)
    assert all(t.is_meta for m in layout.modules.values() for t in (m.a, m.b))
    assert (store.rank(7), store.nbytes(7), layout.scaling) == (4, want.nbytes, want.scaling)
    assert_same(_read(store, 7), want)
    assert store.state(7) == "host"


def test_layout_of_peft_folders_equals_their_full_parse(bank: FixtureBank) -> None:
    """PEFT's own files (target_parameters; per-expert keys) parse the same on meta tensors."""
    targets = _model_targets(bank)
    for path in (bank.peft_adapter(ARCH), bank.per_expert_adapter(ARCH)):
        kwargs = dict(max_rank=MAX_LORA_RANK, dtype=torch.float32)
        want = load_adapter("x", str(path), targets, **kwargs)
        got = load_adapter("x", str(path), targets, **kwargs, meta=True)
        assert (got.rank, got.scaling, got.nbytes) == (want.rank, want.scaling, want.nbytes)
        for key, m in want.modules.items():
            assert got.modules[key].a.shape == m.a.shape and got.modules[key].b.shape == m.b.shape


def _model_targets(bank: FixtureBank) -> dict[str, LoraTarget]:
    """The LoRA targets of the refusal tests' model (every layer has experts)."""
    d = hf.read_dims(bank.model(ARCH))
    assert all(d.sparse_layers) and not d.shared_intermediate
    targets = {}
    for i in range(d.num_layers):
        for key, args in {
            "qkv": (d.hidden, (d.q_size, d.kv_size, d.kv_size), 0),
            "o": (d.q_size, (d.hidden,), 0),
            "experts13": (d.hidden, (d.moe_intermediate,) * 2, d.num_experts),
            "experts2": (d.moe_intermediate, (d.hidden,), d.num_experts),
        }.items():
            targets[f"layers.{i}.{key}"] = LoraTarget(f"layers.{i}.{key}", *args, None, "")
    return targets


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_refused_at_registration_as_load_adapter_refuses(bank: FixtureBank, case: Case) -> None:
    path = str(bank.adapter(f"refused-{case.name}", lambda p: case.build(bank, p)))
    targets = _model_targets(bank)
    with pytest.raises(AdapterError) as want:
        load_adapter("bad", path, targets, max_rank=MAX_LORA_RANK, dtype=torch.float32)
    store = AdapterStore(targets, max_rank=MAX_LORA_RANK, dtype=torch.float32, pin=False)
    try:
        with pytest.raises(AdapterError) as got:
            store.add_folder(0, "bad", path)
        assert str(got.value) == str(want.value)
        with pytest.raises(KeyError):
            store.state(0)  # nothing half-registered
    finally:
        store.close()


# ---- reads ---------------------------------------------------------------------------------


def test_get_reads_once_in_the_background(tmp_path, make_store, monkeypatch) -> None:
    gate = Gate(monkeypatch, tmp_path)
    path = _write_peft(tmp_path / "a", rank=8, seed=2)
    store = make_store()
    store.add_folder(0, "a", path)
    assert gate.reads == 0
    assert store.get(0) is None
    assert gate.started.wait(TIMEOUT)
    assert store.get(0) is None  # the engine asks again each step: still the one read
    store.prefetch(0)
    assert store.state(0) == "reading" and store.completed() == []
    gate.opened.set()
    _wait(store, 0)
    assert store.state(0) == "host"
    assert_same(store.get(0), _load(path))
    assert gate.reads == 1


def test_prefetch_reads_without_a_use(tmp_path, make_store) -> None:
    store = make_store(max_cpu_loras=2)
    for load in range(3):
        store.add_folder(load, f"a{load}", _write_peft(tmp_path / f"a{load}", rank=4, seed=load))
    _read(store, 0)
    _read(store, 1)
    store.prefetch(0)  # resident: no use recorded, 0 stays the least recently used
    store.prefetch(2)
    _wait(store, 2)
    assert [store.state(load) for load in range(3)] == ["disk", "host", "host"]


# ---- eviction ------------------------------------------------------------------------------


def test_lru_eviction_by_count(tmp_path, make_store) -> None:
    store = make_store(max_cpu_loras=2)
    for load in range(4):
        store.add_folder(load, f"a{load}", _write_peft(tmp_path / f"a{load}", rank=4, seed=load))
    _read(store, 0)
    _read(store, 1)
    assert store.get(0) is not None  # 1 is now the least recently used
    _read(store, 2)
    assert [store.state(load) for load in range(4)] == ["host", "disk", "host", "disk"]
    _read(store, 3)
    assert [store.state(load) for load in range(4)] == ["disk", "disk", "host", "host"]


def test_lru_eviction_by_bytes(tmp_path, make_store) -> None:
    ranks = [8, 2, 4]
    paths = [_write_peft(tmp_path / f"a{i}", rank=r, seed=i) for i, r in enumerate(ranks)]
    nbytes = [_load(p).nbytes for p in paths]
    assert len(set(nbytes)) == 3
    store = make_store(max_cpu_bytes=nbytes[1] + nbytes[2])  # too small for 0 beside either
    for load, path in enumerate(paths):
        store.add_folder(load, f"a{load}", path)
        assert store.nbytes(load) == nbytes[load]
    _read(store, 0)
    _read(store, 1)
    assert [store.state(load) for load in range(3)] == ["disk", "host", "disk"]
    _read(store, 2)
    assert [store.state(load) for load in range(3)] == ["disk", "host", "host"]
    _read(store, 0)
    assert [store.state(load) for load in range(3)] == ["host", "disk", "disk"]


def test_held_adapters_are_never_evicted(tmp_path, make_store) -> None:
    store = make_store(max_cpu_loras=1)
    for load in range(3):
        store.add_folder(load, f"a{load}", _write_peft(tmp_path / f"a{load}", rank=4, seed=load))
    store.hold(0)
    _read(store, 0)
    _read(store, 1)  # nothing can go: over the bound, not failed
    assert [store.state(load) for load in range(3)] == ["host", "host", "disk"]
    _read(store, 2)
    assert [store.state(load) for load in range(3)] == ["host", "disk", "host"]
    store.release(0)
    assert [store.state(load) for load in range(3)] == ["disk", "disk", "host"]


def test_in_memory_adapters_count_and_stay(tmp_path, make_store) -> None:
    store = make_store(max_cpu_loras=2)
    mem = random_adapter("mem", _targets(), rank=4, seed=9, dtype=torch.float32, device="cpu")
    store.add_tensors(0, mem)
    assert store.state(0) == "host" and store.get(0) is mem
    assert (store.rank(0), store.nbytes(0)) == (4, mem.nbytes)
    for load in (1, 2, 3):
        store.add_folder(load, f"a{load}", _write_peft(tmp_path / f"a{load}", rank=4, seed=load))
    _read(store, 1)
    _read(store, 2)  # over the bound: 1 goes, 0 never does
    assert [store.state(load) for load in range(4)] == ["host", "disk", "host", "disk"]
    mem2 = random_adapter("m2", _targets(), rank=2, seed=3, dtype=torch.float32, device="cpu")
    store.add_tensors(4, mem2)
    assert [store.state(load) for load in range(5)] == ["host", "disk", "disk", "disk", "host"]
    _read(store, 3)  # just read: stays until a later eviction, beside the two in memory
    assert [store.state(load) for load in range(5)] == ["host", "disk", "disk", "host", "host"]


# ---- failures, removal, shutdown -----------------------------------------------------------


def test_a_file_gone_after_registration_fails_at_get(tmp_path, make_store) -> None:
    path = _write_peft(tmp_path / "a", rank=4, seed=5)
    want = _load(path)
    weights = Path(path) / "adapter_model.safetensors"
    aside = tmp_path / "aside.safetensors"
    store = make_store()
    store.add_folder(0, "a", path)
    os.rename(weights, aside)  # a rename keeps size and mtime: putting it back is no change
    with pytest.raises(AdapterError) as gone:
        _load(path)
    assert store.get(0) is None
    _wait(store, 0)
    assert store.state(0) == "failed"
    with pytest.raises(AdapterError) as got:
        store.get(0)
    assert str(got.value) == str(gone.value)
    assert store.state(0) == "disk"  # reported once; the next get reads again
    os.rename(aside, weights)
    assert_same(_read(store, 0), want)


def test_a_file_changed_after_registration_fails_at_get(tmp_path, make_store) -> None:
    path = _write_peft(tmp_path / "a", rank=4, seed=5)
    store = make_store()
    store.add_folder(0, "a", path)
    _write_peft(tmp_path / "a", rank=4, seed=6)  # same shapes, other weights
    os.utime(Path(path) / "adapter_model.safetensors", ns=(1, 1))  # however coarse the clock
    assert store.get(0) is None
    _wait(store, 0)
    with pytest.raises(AdapterError, match="changed since it was loaded"):
        store.get(0)


def test_remove_during_a_read_discards_it(tmp_path, make_store, monkeypatch) -> None:
    gate = Gate(monkeypatch, tmp_path)
    store = make_store()
    store.add_folder(0, "a", _write_peft(tmp_path / "a", rank=4, seed=1))
    store.add_folder(1, "b", _write_peft(tmp_path / "b", rank=4, seed=2))
    assert store.get(0) is None
    assert gate.started.wait(TIMEOUT)
    store.remove(0)
    with pytest.raises(KeyError):
        store.state(0)
    gate.opened.set()
    _read(store, 1)  # one worker, in order: 0's read has ended, unseen
    assert gate.reads == 2
    with pytest.raises(KeyError):
        store.get(0)


def test_close_joins_the_worker(tmp_path, monkeypatch) -> None:
    gate = Gate(monkeypatch, tmp_path)
    store = _store()
    store.add_folder(0, "a", _write_peft(tmp_path / "a", rank=4, seed=1))
    store.add_folder(1, "b", _write_peft(tmp_path / "b", rank=4, seed=2))
    assert store.get(0) is None
    store.prefetch(1)  # queued behind 0: cancelled, unless the worker has taken it already
    assert gate.started.wait(TIMEOUT)
    # this store's worker, told by the read it runs (other tests' engines may read meanwhile)
    worker = gate.thread
    assert worker is not None and worker.name.startswith("moelora-adapter-read")
    gate.opened.set()
    store.close()
    assert not worker.is_alive()
    assert store.completed() == []


def test_an_unreadable_file_fails_only_its_load(tmp_path, make_store) -> None:
    store = make_store()
    store.add_folder(0, "a", _write_peft(tmp_path / "a", rank=4, seed=1))
    store.add_folder(1, "b", _write_peft(tmp_path / "b", rank=4, seed=2))
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(b"\x07" * 64)
    assert store.get(0) is None and store.get(1) is None
    _wait(store, 0, 1)
    with pytest.raises(AdapterError, match=r"adapter 'a': reading .* failed"):
        store.get(0)
    assert store.get(1) is not None


def test_pin_pins_on_the_worker(tmp_path, monkeypatch) -> None:
    """pin=True: host copies are page-locked by the worker, in-memory ones when added (pinning
    itself needs an accelerator, so LoraAdapter.pinned stands in)."""
    pinned_on: list[str] = []

    def pinned(adapter: LoraAdapter) -> LoraAdapter:
        pinned_on.append(threading.current_thread().name)
        return adapter

    monkeypatch.setattr(LoraAdapter, "pinned", pinned)
    store = AdapterStore(_targets(), max_rank=MAX_RANK, dtype=torch.float32, pin=True)
    try:
        mem = random_adapter("mem", _targets(), rank=2, seed=1, dtype=torch.float32, device="cpu")
        store.add_tensors(0, mem)
        store.add_folder(1, "a", _write_peft(tmp_path / "a", rank=4, seed=1))
        _read(store, 1)
    finally:
        store.close()
    assert pinned_on[0] == threading.current_thread().name
    assert pinned_on[1].startswith("moelora-adapter-read") and len(pinned_on) == 2
