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

With prefix caching a new request starts with the indexed blocks of its prompt's first full
blocks (`KVPages.share_prefix`) and prefills the rest; a request whose prompt shares full blocks
with one still prefilling them waits for that prefill (a GRPO group's other members are admitted
a step after the first, and prefill only their last block); their seats under `max_num_seqs`
are kept for them, so later prompts do not take them and leave them to run after the blocks
they would share are freed.
"""

from __future__ import annotations

from collections import deque
from operator import attrgetter

from ..errors import InputError
from .block_manager import KVPages
from .sequence import Sequence, Status

_ARRIVAL = attrgetter("arrival")


class CacheFull(Exception):
    """A sequence cannot grow even with every other sequence preempted."""

    def __init__(self, seq: Sequence):
        super().__init__(f"request {seq.request_id}")
        self.seq = seq


class Scheduler:
    def __init__(self, blocks: KVPages, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix_caching: bool = True):
        if not isinstance(prefix_caching, bool):  # (the engine's argument)
            raise InputError(f"Engine prefix_caching must be True or False, got {prefix_caching!r}")
        self.blocks = blocks
        self.prefix_caching = prefix_caching
        self.window = min((g.window for g in blocks.groups if g.window), default=0)
        """The sliding layers' window (0: none): a block trimmed behind it ends what can be shared."""
        self.version = 0  # the engine's policy version (the engine sets it before each step)
        self.epoch = 0  # weight loads so far (a load may reuse a version): this one's blocks are shared
        self.shared_tokens = 0  # prompt tokens whose keys and values were shared, not computed
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

    def new_weights(self) -> None:
        """New weights are loaded: no block computed before is shared from now on."""
        self.epoch += 1
        self.blocks.forget()

    def _prefilling(self) -> dict[tuple, list[Sequence]]:
        """Running sequences still prefilling keys of the weights now, by their first block."""
        bs, out = self.blocks.block_size, {}
        for s in self.running:
            if s.cache_epoch == self.epoch and len(s.token_ids) - s.num_computed > 1:
                out.setdefault(tuple(s.token_ids[:bs]), []).append(s)
        return out

    def _waits_for_prefix(self, seq: Sequence, prefilling: dict[tuple, list[Sequence]]) -> bool:
        """Whether `seq` (new) could share full blocks that a prefilling sequence computes later."""
        if not self.prefix_caching or seq.num_computed or self.blocks.owns(seq.request_id):
            return False
        bs, ids = self.blocks.block_size, seq.token_ids
        if len(ids) <= bs:  # (no full block before its last token)
            return False
        for other in prefilling.get(tuple(ids[:bs]), ()):
            end = bs
            while end + bs < len(ids) and ids[end:end + bs] == other.token_ids[end:end + bs]:
                end += bs  # (full blocks in common, the last token of `ids` left to compute)
            if self.window and end >= self.window + bs - 1:  # (its prefill trims the first block:
                continue  # the sliding layers' prefix will not be there to share)
            if other.num_computed < end:  # (`seq` waits: never among the prefilling)
                return True
        return False

    def _share(self, seq: Sequence) -> int:
        """Start a new sequence on the indexed blocks of its prompt; the tokens they hold."""
        if not self.prefix_caching or seq.num_computed or self.blocks.owns(seq.request_id):
            return 0
        seq.cache_version, seq.cache_epoch = self.version, self.epoch
        seq.num_computed = self.blocks.share_prefix(seq.request_id, seq.token_ids, len(seq.token_ids) - 1)
        return seq.num_computed

    def _unshare(self, seq: Sequence, shared: int) -> None:
        if shared:
            self.blocks.release(seq.request_id)
            seq.num_computed = 0

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
        for seq in self.running:
            if self.prefix_caching and seq.cache_epoch == self.epoch:  # (its cache is these weights')
                self.blocks.enter(seq.request_id, seq.token_ids, seq.num_computed)
            self.blocks.trim(seq.request_id, seq.num_computed)  # (a sliding layer's blocks no query sees)
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
        admits = self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
        prefilling = self._prefilling() if self.prefix_caching and admits else {}
        later: set[int] = set()  # new requests waiting for a prefix another one computes (their seats
        while self.waiting and budget > 0 and len(self.running) + len(later) < self.max_num_seqs:  # kept)
            seq = next((s for s in self.waiting if (self.admit or s.turn_tokens)  # (a drain waits: only
                        and s.request_id not in later), None)  # turns already started go on)
            if seq is None:
                break
            if self._waits_for_prefix(seq, prefilling):
                later.add(seq.request_id)
                continue
            shared = self._share(seq)
            n = min(seq.num_pending, budget)
            self.blocks.trim(seq.request_id, seq.num_computed)  # (a continued turn's cache)
            if not self.blocks.can_grow(seq.request_id, seq.num_computed + n):
                victims = self._cached_idle(seq)
                if victims or self.running or batch:
                    self._unshare(seq, shared)  # (it is admitted later, and shares then)
                    if not victims:
                        break
                    self._preempt(victims[0])
                    continue
                room = self.blocks.room(seq.request_id) - seq.num_computed
                if room < 1:  # nothing else could free memory
                    self._unshare(seq, shared)
                    self.waiting.remove(seq)
                    raise CacheFull(seq)
                n = min(n, room)  # alone: feed what fits (a window's blocks free as the prefill moves on)
            self.shared_tokens += shared
            self.waiting.remove(seq)
            self.blocks.grow(seq.request_id, seq.num_computed + n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            if shared or not seq.num_computed:
                prefilling.setdefault(tuple(seq.token_ids[:self.blocks.block_size]), []).append(seq)
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
