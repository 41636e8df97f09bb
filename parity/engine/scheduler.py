"""Scheduler: continuous batching with chunked prefill and preemption by recompute.

Every step it picks, under `max_num_seqs` and a token budget, what each sequence feeds to the
model: running sequences first (one token when decoding, a chunk when still prefilling), then
waiting ones in arrival order. When the KV cache cannot grow, paused multi-turn sequences, then
waiting ones that still hold a cache (continued turns not yet admitted), then the most recently
arrived running sequences are preempted: their blocks are freed and their tokens recomputed later
(with aligned kernels the recomputed cache holds the same bits).

While a drain-mode weight update waits (`admit` False), no new turn starts, but a sequence that
has sampled tokens in its current turn (a running one, or one preempted mid-turn) is *started*:
it is still admitted and finishes its turn on the old weights before they are replaced.
"""

from __future__ import annotations

from collections import deque
from operator import attrgetter

from .block_manager import KVPages
from .sequence import Sequence, Status

_ARRIVAL = attrgetter("arrival")


class CacheFull(Exception):
    """A sequence cannot grow even with every other sequence preempted."""

    def __init__(self, seq: Sequence):
        super().__init__(f"request {seq.request_id}")
        self.seq = seq


class Scheduler:
    def __init__(self, blocks: KVPages, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.paused: dict[int, Sequence] = {}
        self.admit = True  # False while a drain-mode weight update waits for running to empty
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def resume(self, seq: Sequence) -> None:
        """A paused multi-turn sequence got new tokens: queue it first for admission (under the
        same limits as new requests); its cached blocks, if any, are kept."""
        self.paused.pop(seq.request_id, None)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def drop_caches(self) -> None:
        """Free the caches of sequences not running (paused, or continued and waiting): built by
        old weights, they are recomputed under the new ones when the sequences run again."""
        for seq in [*self.paused.values(), *self.waiting]:
            self.blocks.release(seq.request_id)
            seq.num_computed = 0

    def started(self) -> bool:
        """Whether a sequence is in the middle of a turn (running, or preempted mid-turn): a
        drain-mode update waits for these."""
        return bool(self.running) or any(s.turn_tokens for s in self.waiting)

    def _cached_idle(self, exclude: Sequence) -> list[Sequence]:
        """Sequences holding cache blocks without running: paused ones, then waiting ones."""
        return [s for s in [*self.paused.values(), *self.waiting]
                if s is not exclude and self.blocks.owns(s.request_id)]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq.request_id)
        seq.num_computed = 0
        self.num_preemptions += 1
        if seq.request_id in self.paused or seq.status is Status.WAITING:
            return  # stays paused or waiting; recomputed when it runs
        seq.status = Status.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def _make_room(self, seq: Sequence, length: int) -> bool:
        """Free blocks until `seq` can grow to `length` tokens; False if impossible."""
        while not self.blocks.can_grow(seq.request_id, length):
            victims = self._cached_idle(seq)
            if victims:
                self._preempt(victims[0])
                continue
            youngest = max(self.running, key=lambda s: s.arrival) if self.running else seq
            if youngest is seq or seq not in self.running:
                return False  # the caller itself is the one to wait
            self._preempt(youngest)
        return True

    def schedule(self) -> list[tuple[Sequence, int]]:
        """This step's (sequence, number of new tokens to feed) pairs."""
        budget = self.max_num_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        for seq in self.running:  # (a sliding layer's blocks behind every later query's window)
            self.blocks.trim(seq.request_id, seq.num_computed)
        for seq in sorted(self.running, key=_ARRIVAL):
            pending = len(seq.token_ids) - seq.num_computed
            if seq.status is not Status.RUNNING or pending == 0 or budget == 0:
                continue
            n = min(pending, budget)
            if self.blocks.holds(seq.request_id, seq.num_computed + n):
                batch.append((seq, n))  # its blocks hold the new tokens already (most decode steps)
                budget -= n
                continue
            if not self._make_room(seq, seq.num_computed + n):
                room = self.blocks.room(seq.request_id) - seq.num_computed
                if room >= 1:
                    n = min(n, room)  # feed what fits now
                elif len(self.running) == 1:
                    raise CacheFull(seq)  # alone and no room at all: it can never continue
                else:
                    self._preempt(seq)  # the youngest waits for older ones to finish
                    continue
            if seq.status is Status.RUNNING:  # not preempted by an earlier sequence's growth
                self.blocks.grow(seq.request_id, seq.num_computed + n)
                batch.append((seq, n))
                budget -= n
        batch = [(s, n) for s, n in batch if s.status is Status.RUNNING]
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0] if self.admit else next((s for s in self.waiting if s.turn_tokens), None)
            if seq is None:  # a drain waits: only turns already started go on
                break
            n = min(seq.num_pending, budget)
            self.blocks.trim(seq.request_id, seq.num_computed)  # (a continued turn's cache)
            if not self.blocks.can_grow(seq.request_id, seq.num_computed + n):
                victims = self._cached_idle(seq)
                if victims:
                    self._preempt(victims[0])
                    continue
                if self.running or batch:
                    break
                room = self.blocks.room(seq.request_id) - seq.num_computed
                if room < 1:  # nothing else could free memory
                    self.waiting.remove(seq)
                    raise CacheFull(seq)
                n = min(n, room)  # alone: feed what fits (a window's blocks free as the prefill moves on)
            self.waiting.remove(seq)
            self.blocks.grow(seq.request_id, seq.num_computed + n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        return batch

    def finish(self, seq: Sequence, pause: bool) -> None:
        """Take a sequence out of the running set; keep its cache if it pauses (multi-turn)."""
        self.running.remove(seq)
        if pause:
            seq.status = Status.PAUSED
            self.paused[seq.request_id] = seq
            self.blocks.trim(seq.request_id, seq.num_computed)  # (idle: a window's blocks at most)
        else:
            seq.status = Status.FINISHED
            self.blocks.release(seq.request_id)

    def release(self, seq: Sequence) -> None:
        self.paused.pop(seq.request_id, None)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq.request_id)
        seq.status = Status.FINISHED
