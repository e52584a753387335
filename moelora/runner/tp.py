"""Rank 0 and the other ranks of a tensor-parallel engine: the commands rank 0 sends, the
Workers handle it sends them through, and the loop a worker runs them in.

Rank 0 plans every step; the workers only repeat its forward on their shard. Each command goes
down one pipe per worker (pickled once), in the order rank 0 runs it, so every rank enters the
same collectives in the same order. A pipe has no timeout to outlive: an idle engine leaves its
workers blocked in recv(), and a recv() that finds the pipe closed (rank 0 gone) ends them.
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from moelora.errors import EngineDeadError
from moelora.lora.adapter import LoraAdapter, ModuleLora
from moelora.step.batch import HostBatch

log = logging.getLogger(__name__)

_JOIN_SECONDS = 10.0
_REAP_SECONDS = 1.0  # for a failed pipe or collective to show which worker exited


@dataclass(frozen=True)
class Forward:
    """One step's forward: its inputs, then the lm_head on each of `rows` of its hidden states,
    in order (the prompt-logprob windows, then the sampled rows)."""

    host: HostBatch
    rows: list[torch.Tensor]


@dataclass(frozen=True)
class FillSlot:
    slot: int
    adapter: LoraAdapter  # the whole adapter, on the host: each rank cuts its part


@dataclass(frozen=True)
class ClearSlot:
    slot: int


@dataclass(frozen=True)
class Stop:
    pass


def on_host(adapter: LoraAdapter) -> LoraAdapter:
    """The adapter with its tensors on the CPU, to pickle (a worker has its own device)."""
    modules = {k: ModuleLora(m.a.cpu(), m.b.cpu()) for k, m in adapter.modules.items()}
    return LoraAdapter(adapter.name, adapter.path, adapter.rank, adapter.scaling, modules)


class Workers:
    """Rank 0's handle on ranks 1..N-1: their processes and the pipe to each."""

    def __init__(self, processes: list[Any], pipes: list[Any], *, keep: object = None):
        """keep: what must live as long as the group (rank 0's TCPStore, which serves it)."""
        self.processes = processes
        self.pipes = pipes
        self._keep = keep
        self.dead: str | None = None  # why the engine cannot go on, once it cannot

    def send(self, command: object) -> None:
        """`command` to every worker; an EngineDeadError if one has died."""
        self.check()
        data = pickle.dumps(command)
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                pipe.send_bytes(data)
            except OSError as e:
                self.fail(f"rank {rank} no longer reads its commands ({e})")

    def check(self) -> None:
        """An EngineDeadError naming the first worker that has exited, if one has."""
        if self.dead is None:
            for rank, p in enumerate(self.processes, start=1):
                if not p.is_alive():
                    self.dead = (
                        f"tensor-parallel rank {rank} (pid {p.pid}) exited with code "
                        f"{p.exitcode}: the engine cannot go on; start a new one"
                    )
                    break
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    def fail(self, why: str) -> None:
        """A collective or a pipe failed: the engine is dead from now on."""
        for p in self.processes:  # a worker that exited is the likelier cause: name it
            p.join(_REAP_SECONDS)
        self.check()
        self.dead = f"tensor-parallel engine failed: {why}; start a new one"
        raise EngineDeadError(self.dead)

    def close(self) -> None:
        """Stop the workers and join them (a worker that does not stop is terminated)."""
        for pipe in self.pipes:
            try:
                pipe.send_bytes(pickle.dumps(Stop()))
            except OSError:
                pass  # already gone
        for p in self.processes:
            p.join(_JOIN_SECONDS)
            if p.is_alive():
                log.warning("tensor-parallel worker pid %d did not stop: terminated", p.pid)
                p.terminate()
                p.join(_JOIN_SECONDS)
        for pipe in self.pipes:
            pipe.close()
        self.dead = self.dead or "the engine is closed"


def serve(runner: Any, pipe: Any) -> None:
    """A worker's loop: run rank 0's commands on this rank's shard until Stop, or until rank 0
    is gone (the pipe closes). runner: this rank's ModelRunner."""
    while True:
        try:
            command = pickle.loads(pipe.recv_bytes())
        except (EOFError, OSError):
            return  # rank 0 went away
        if isinstance(command, Stop):
            return
        if isinstance(command, Forward):
            runner.forward_rows(command.host, None, command.rows)
        elif isinstance(command, FillSlot):
            runner.fill_slot(command.slot, command.adapter)
        elif isinstance(command, ClearSlot):
            runner.clear_slot(command.slot)
        else:
            raise AssertionError(f"unknown command {command!r}")
