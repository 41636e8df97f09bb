"""`Engine`: the rollout engine — scheduler, block manager, model runner and sampler in a loop.

    engine = Engine(model, max_num_seqs=64)
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=64, seed=0))

Every recorded log-prob equals, bit for bit, what `sequence_logprobs` computes for the same
weights and tokens when the model runs on aligned kernels, whatever else shares the batch.
Weights can be swapped without a restart (`update_weights`, drain or in-flight), and a request
can run several turns, with environment tokens appended between them (`continue_request`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from collections.abc import Sequence as Seq

import torch

from ..errors import InputError
from ..model.kv_cache import KVCache
from ..model.logprobs import check_model, token_list
from .calls import decode_failed, one_thread, repeats, sampling_params
from .memory import DEFAULT_KV_CACHE_MEMORY, describe_cache, plan_cache
from .model_runner import ModelRunner
from .sampler import Sampler
from .scheduler import CacheFull, Scheduler
from .sequence import RequestOutput, SamplingParams, Sequence, Status

log = logging.getLogger(__name__)

WEIGHT_MODES = ("inflight", "drain")


class Engine:
    def __init__(self, model, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 kv_cache_tokens: int | None = None, tokenizer=None, seed: int = 0,
                 kv_cache_memory: float | int | str = DEFAULT_KV_CACHE_MEMORY, graphs: str = "auto",
                 prefix_caching: bool = True):
        """`kv_cache_tokens` fixes the cache size; otherwise it holds what `kv_cache_memory` (a
        fraction of the memory available on the model's device, or bytes) allows, and never more
        than `max_num_seqs` sequences of min(max_position_embeddings, 2048) tokens can use.
        `graphs`: decode steps replayed as CUDA graphs on a GPU ('auto', dense models), never
        ('off'), or their static padded step run eagerly ('emulate': tests on a CPU); see
        `graphs.py`. `prefix_caching`: a request whose prompt starts with full blocks of tokens
        already in the cache, computed under the weights loaded now, shares them (`block_manager.py`)."""
        sizes = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                 "kv_cache_tokens": 1 if kv_cache_tokens is None else kv_cache_tokens}
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"Engine {name} must be a positive integer, got {value!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 63:
            # (a None one failed the first step, and the engine never stepped its requests again)
            raise InputError(f"Engine seed must be an integer in 0..2**63-1, got {seed!r}")
        check_model(model, "Engine")
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):  # (failed at the end)
            raise InputError(f"Engine tokenizer must be a tokenizer (with decode()), "
                             f"got {type(tokenizer).__name__}")
        self.model = model
        self.tokenizer = tokenizer
        bs, cfg = model.block_size, model.config
        num_blocks, window_blocks = plan_cache(model, kv_cache_tokens, kv_cache_memory, max_num_seqs,
                                               max_num_batched_tokens)
        size = KVCache.bytes_for(cfg, model.dtype, bs, num_blocks, window_blocks)
        size -= KVCache.bytes_for(cfg, model.dtype, bs, 0, None if window_blocks is None else 0)
        self.cache_info = {"tokens": num_blocks * bs, "bytes": size, "window_blocks": window_blocks,
                           "full_length_seqs": num_blocks * bs // cfg.max_position_embeddings,
                           "every_layer_slides": KVCache.layer_groups(cfg, 1, window_blocks)[0][0]}
        """The cache's capacity: tokens, bytes (the pad and scratch blocks aside), the sliding
        layers' own blocks (None: every layer in the same blocks), how many sequences of
        max_position_embeddings tokens it holds at once, and the window when every layer slides
        (each sequence then holds its window, whatever its length; else 0)."""
        log.debug("engine: %s", self.describe_cache())
        self.runner = ModelRunner(model, num_blocks, graphs, window_blocks)
        self.blocks = self.runner.pages
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens, prefix_caching)
        self.sampler = Sampler(model, seed)
        # the model's end-of-sequence ids, and those the tokenizer's directory adds (generation_config)
        self._eos = frozenset(model.config.eos_token_ids) | frozenset(getattr(tokenizer, "eos_token_ids", ()))
        self.policy_version = 0
        self._pending: tuple[Mapping[str, torch.Tensor], int] | None = None
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self.seqs: dict[int, Sequence] = {}
        self.step_times: deque[float] = deque(maxlen=100_000)  # (a long-lived engine's grew for good)
        self._unchecked: list[Sequence] = []  # sampled, stop check not yet run (an interrupt came)
        self._finished: list[RequestOutput] = []  # finished, not yet returned by step()
        self._lock, self._in_before_step, self._warned_cache_full = threading.RLock(), False, False

    def describe_cache(self) -> str:
        """The cache's capacity in one line (what the commands print at start-up)."""
        m = self.model
        return describe_cache(self.cache_info, m.config.max_position_embeddings, m.block_size)

    # ------------------------------------------------------------------ requests
    def _check_tokens(self, tokens: Seq[int], what: str) -> list[int]:
        ids = token_list(tokens, what)  # (floats were truncated, strings split into characters)
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InputError(f"{what}: token id {bad[0]} is outside the vocabulary (vocab_size={vocab})")
        return ids

    @one_thread()
    def add_request(self, prompt: Seq[int], params: SamplingParams | None = None,
                    multi_turn: bool = False) -> int:
        """Queue a request; returns its id. Raises `InputError` for a bad prompt."""
        if not isinstance(multi_turn, bool):  # ('no' was true: the request paused, holding its cache)
            raise InputError(f"multi_turn must be True or False, got {multi_turn!r}")
        params = sampling_params(params, self.tokenizer, self.model.config.vocab_size)
        ids = self._check_tokens(prompt, "prompt")
        limit = self.model.config.max_position_embeddings
        if not ids:
            raise InputError("prompt: empty prompt")
        if len(ids) >= limit:
            raise InputError(f"prompt: length {len(ids)} leaves no room to generate "
                             f"(max_position_embeddings={limit})")
        capacity = self.blocks.capacity_tokens
        if len(ids) > capacity:
            raise InputError(f"prompt: length {len(ids)} does not fit the KV cache "
                             f"({capacity} tokens; raise kv_cache_memory or kv_cache_tokens)")
        rid = next(self._ids)
        seq = Sequence(rid, ids, params, prompt_len=len(ids), multi_turn=multi_turn,
                       arrival=next(self._arrivals))
        self.seqs[rid] = seq
        self.scheduler.add(seq)
        return rid

    @one_thread()
    def continue_request(self, request_id: int, env_tokens: Seq[int],
                         params: SamplingParams | None = None) -> None:
        """Append environment tokens (loss_mask 0) to a paused multi-turn request and let it
        generate its next turn, its cached prefix kept."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.status is not Status.PAUSED:
            raise InputError(f"request {request_id}: not a paused multi-turn request")
        if params is not None:  # (checked before the request changes: a retry appended twice)
            params = sampling_params(params, self.tokenizer, self.model.config.vocab_size)
        ids = self._check_tokens(env_tokens, f"request {request_id} environment tokens")
        if len(seq) + len(ids) >= self.model.config.max_position_embeddings:
            raise InputError(f"request {request_id}: {len(seq)} tokens so far and {len(ids)} environment "
                             f"tokens exceed the context, leaving no room for a next turn "
                             f"(max_position_embeddings = {self.model.config.max_position_embeddings})")
        if len(seq) + len(ids) > self.blocks.capacity_tokens:
            seq.cache_full = True  # (what the request is released with says why it ended)
            raise InputError(f"request {request_id}: {len(seq)} tokens so far and {len(ids)} environment "
                             f"tokens do not fit the KV cache with a token to generate "
                             f"({self.blocks.capacity_tokens} tokens; raise kv_cache_memory or "
                             "kv_cache_tokens)")
        seq.append_environment(ids)
        if params is not None:
            if params.seed is not None and params.seed != seq.params.seed:
                seq.generator = torch.Generator().manual_seed(params.seed)
                seq.draw_seed, seq.draws = params.seed, 0  # counter draws restart as the generator does
            seq.params = params
        seq.turn_tokens = 0
        seq.finish_reason, seq.cache_full = None, False
        self.scheduler.resume(seq)

    @one_thread()
    def release(self, request_id: int) -> RequestOutput:
        """Finish a (paused) request for good and free its cache."""
        if request_id not in self.seqs:
            raise InputError(f"request {request_id}: no such request in this engine")
        seq = self.seqs.pop(request_id)
        self.scheduler.release(seq)
        return self._output(seq)

    # ------------------------------------------------------------------ weights
    @one_thread(in_before_step=True)
    def update_weights(self, state: Mapping[str, torch.Tensor], version: int,
                       mode: str = "inflight", copy: bool = True) -> None:
        """Load new weights tagged `version`. `inflight`: running sequences continue on them from
        their next token, KV cache kept (the tokens sampled over keys and values of older weights
        say so in `cache_versions`). `drain`: no new turn starts until the turns under way
        (running, or preempted mid-turn) finish on the old weights; then the new weights are
        loaded and every other cache (paused or continued turns) is recomputed under them. An
        update while another waits is merged into it (a partial state keeps the earlier one's
        other tensors). A drain that waits keeps a copy of `state` (`copy=False`: the caller's
        tensors, which must then stay unchanged until they load; a learner stepping them in place
        had its later weights loaded under this version)."""
        if mode not in WEIGHT_MODES:
            raise InputError(f"unknown weight update mode {mode!r}: expected one of {WEIGHT_MODES}")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:  # (tagged tokens)
            raise InputError(f"update_weights: version must be an integer >= 0, got {version!r}")
        if not isinstance(state, Mapping):
            raise InputError(f"update_weights: state must map tensor names to tensors, "
                             f"got {type(state).__name__}")
        params = dict(self.model.named_parameters())
        for name, value in state.items():  # check everything before touching any weight
            if name not in params:
                raise InputError(f"update_weights: unknown tensor {name}")
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
                raise InputError(f"update_weights: tensor {name} must be a floating-point torch.Tensor, "
                                 f"got {got}")
            if tuple(value.shape) != tuple(params[name].shape):
                raise InputError(f"update_weights: tensor {name} has shape {tuple(value.shape)}, "
                                 f"the model's is {tuple(params[name].shape)}")
            if not torch.isfinite(value.to(params[name].dtype)).all():  # (1e39 is inf in float32)
                raise InputError(f"update_weights: tensor {name} contains NaN or inf in the model's "
                                 f"{params[name].dtype}")
        waits = mode == "drain" and self.scheduler.started()
        if waits and copy:
            state = {k: v.detach().clone() for k, v in state.items()}
        if self._pending is not None:  # one waits already: nothing of it may be lost
            pending, _ = self._pending
            state = {**pending, **state}
        if not waits:
            self._load(state, version, drained=mode == "drain")
        else:
            self._pending = (state, version)
            self.scheduler.admit = False

    def _load(self, state: Mapping[str, torch.Tensor], version: int, drained: bool = False) -> None:
        with torch.no_grad():
            params = dict(self.model.named_parameters())
            for name, value in state.items():
                params[name].copy_(value)
        self.model.invalidate_fused()
        self.scheduler.new_weights()
        if drained:  # the caches of turns not under way were built by the old weights
            self.scheduler.drop_caches()
        self.policy_version = version
        self._pending = None
        self.scheduler.admit = True

    # ------------------------------------------------------------------ loop
    def has_unfinished(self) -> bool:
        return (self.scheduler.has_work() or self._pending is not None
                or bool(self._unchecked or self._finished))  # (what an interrupted step left)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids:
            return "stop"
        if token in self._eos and not p.ignore_eos:
            return "eos"
        if p.stop_strings and self.tokenizer is not None:
            if any(s in seq.turn_tail(self.tokenizer.decode) for s in p.stop_strings):
                return "stop"
        if seq.turn_tokens >= p.max_tokens:
            return "length"
        if len(seq) >= self.model.config.max_position_embeddings:
            return "length"
        if len(seq) > self.blocks.capacity_tokens:  # the whole cache: its last token can never be fed
            seq.cache_full = True
            if not self._warned_cache_full:  # (once per engine)
                log.warning("request %d ended at the KV cache's %d tokens (finish_reason 'length', "
                            "cache_full): raise kv_cache_memory or kv_cache_tokens", seq.request_id,
                            self.blocks.capacity_tokens)
                self._warned_cache_full = True
            return "length"
        return None

    @one_thread()
    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward and sample; return requests that finished or paused."""
        if self._unchecked or self._finished:  # a step an interrupt cut short: its checks first
            return self._commit()
        if self._pending is not None and not self.scheduler.started():
            self._load(*self._pending, drained=True)
        t0 = time.perf_counter()
        try:
            self.scheduler.version = self.policy_version  # (a rollout worker sets it at start-up)
            batch = self.scheduler.schedule()
        except CacheFull as full:  # (a safety net: the stop check keeps sequences within the cache)
            seq = full.seq
            self.scheduler.release(seq)
            self.seqs.pop(seq.request_id, None)
            seq.finish_reason = "error"
            out = self._output(seq)
            out.error = (f"request {seq.request_id}: KV cache too small for {len(seq)} tokens "
                         f"(raise kv_cache_memory or kv_cache_tokens)")
            return [out]
        if not batch:
            return []
        for seq, _ in batch:
            if seq.num_computed == 0:  # its cache starts (again) under the weights loaded now
                seq.cache_version = self.policy_version
        marks = [(seq, seq.num_computed, seq.draws) for seq, _ in batch]
        try:  # a forward or sampling that fails (out of memory, an interrupt) changes nothing
            ready, logits, routing = self.runner.run(batch, self.blocks)
            sampled = self.sampler.sample(ready, logits) if ready else []
        except BaseException:  # (its sequences sat fed but unsampled, never scheduled again: a hang)
            for seq, computed, _ in marks:
                seq.num_computed = computed  # the cache slots past it are rewritten when run again
            self.sampler.rewind([(seq, draws) for seq, _, draws in marks], self.model.config.vocab_size)
            raise
        for j, (seq, (tok, lp, slp)) in enumerate(zip(ready, sampled)):
            seq.append_sampled(tok, lp, slp, self.policy_version, None if routing is None else routing[j])
        self._unchecked = list(ready)
        self.step_times.append(time.perf_counter() - t0)
        return self._commit()

    def _commit(self) -> list[RequestOutput]:
        """Each sampled sequence's stop check, then the outputs of those that finished. An
        interrupt here (the checks run the user's tokenizer) loses nothing: the next step()
        carries on with the sequences not yet checked and returns what finished (they sat with
        their token appended, never checked nor scheduled again: a hang)."""
        while self._unchecked:
            seq = self._unchecked[0]
            if self.seqs.get(seq.request_id) is not seq:  # released since the interrupt
                self._unchecked.pop(0)
                continue
            try:
                reason, error = self._stop_reason(seq, seq.token_ids[-1]), None
            except Exception as err:  # noqa: BLE001 - the tokenizer failed on this text: this request
                reason, error = "error", decode_failed(seq, err)  # fails, the batch's others go on
            if reason is not None:
                seq.finish_reason = reason
                out = self._output(seq)
                error = error or out.error
                pause = seq.multi_turn and error is None  # (a turn whose text cannot be read ends)
                if error is not None:
                    out.error, out.finish_reason, seq.finish_reason = error, "error", "error"
                self.scheduler.finish(seq, pause=pause)
                if not pause:
                    self.seqs.pop(seq.request_id, None)
                self._finished.append(out)
            self._unchecked.pop(0)
        done, self._finished = self._finished, []
        return done

    def _output(self, seq: Sequence) -> RequestOutput:
        out = RequestOutput.from_sequence(seq)
        if self.tokenizer is not None:
            try:  # (its tokens and log-probs stand; the text is missing and the output says why)
                out.text = self.tokenizer.decode(out.token_ids)
            except Exception as err:  # noqa: BLE001 - any failure of a user's tokenizer
                out.error = decode_failed(seq, err)
        return out

    @one_thread()
    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 before_step=None) -> list[RequestOutput]:
        """Run prompts to completion. A bad prompt gets an output with `error` set while the
        others complete. `params` is one SamplingParams for all or one per prompt.
        `before_step(engine)`, if given, runs before every step (e.g. to load new weights).
        Requests added earlier with `add_request` must be finished first (generate would step
        them along and have nowhere to return their outputs)."""
        if self.scheduler.has_work():
            busy = len(self.scheduler.waiting) + len(self.scheduler.running)
            raise InputError(f"generate: {busy} earlier request(s) from add_request are unfinished; "
                             f"run step() until has_unfinished() is False first")
        if prompts is None or isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__"):
            raise InputError(f"generate: prompts must be a list of token-id lists, "
                             f"got {type(prompts).__name__}")
        if getattr(prompts, "ndim", 2) < 2:  # (a 1-D tensor ran one prompt per token)
            raise InputError(f"generate: prompts must be a list of token-id lists, got a {prompts.ndim}-D "
                             f"{type(prompts).__name__} (wrap one prompt in a list)")
        prompts = list(prompts)  # (a generator was a TypeError: no len())
        if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
            raise InputError("generate: prompts must be a list of token-id lists, got one list of ints "
                             "(wrap one prompt in a list)")  # (each id was run as a prompt of its own)
        if params is None or isinstance(params, SamplingParams):
            if params is not None and params.seed is not None and params.temperature > 0 \
                    and repeats(prompts):  # (a GRPO group drawn so has no variance: nothing to learn)
                log.warning("generate: one SamplingParams with seed=%d for repeated prompts: their samples "
                            "are identical (give each request its own seed)", params.seed)
            params = [params or SamplingParams()] * len(prompts)
        elif isinstance(params, (dict, str, bytes)) or not hasattr(params, "__iter__"):
            raise InputError(f"generate: params must be a SamplingParams or a list of them, "
                             f"got {type(params).__name__}")
        params = list(params)
        if before_step is not None and not callable(before_step):
            raise InputError(f"generate: before_step must be callable, got {type(before_step).__name__}")
        if len(params) != len(prompts):
            raise InputError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        results: list[RequestOutput | None] = [None] * len(prompts)
        index: dict[int, int] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                try:
                    index[self.add_request(prompt, p)] = i
                except InputError as exc:
                    prompt_ids = [t for t in prompt if isinstance(t, int)] \
                        if isinstance(prompt, (list, tuple)) else []
                    results[i] = RequestOutput(-1, prompt_ids, [], [], [], [], [], "error", error=str(exc))
            while any(r is None for r in results) and self.has_unfinished():
                if before_step is not None:
                    self._in_before_step = True
                    try:
                        before_step(self)
                    finally:
                        self._in_before_step = False
                for out in self.step():
                    if out.request_id in index:
                        results[index[out.request_id]] = out
        except BaseException:  # (its requests stayed queued: every later generate() refused to run)
            for rid in index:
                if rid in self.seqs:
                    self.release(rid)
            self._finished = [o for o in self._finished if o.request_id not in index]  # (released too)
            raise
        return results  # type: ignore[return-value]
