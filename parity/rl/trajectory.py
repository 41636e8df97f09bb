"""Trajectories: what the rollout side hands the learner, validated on construction.

Per response: all token ids (prompt + completion, multi-turn allowed), `loss_mask` (1 on
model-sampled tokens, 0 on prompt and environment tokens), `rollout_logprobs` and the
`policy_version` of every sampled token, a scalar reward and a group id (responses to the same
prompt). Per-token lists are aligned with `token_ids`; entry t describes token t. The rollout
worker may add `sampled_learner_logprobs`: the learner path's log-probs under the very weights
that sampled each token (so the learner can split its gap without keeping old weights), and
the engine `cache_versions`: per token the version of the oldest keys/values its forward read
(older than its own version when an in-flight update kept the cache: no single version's
weights sampled such a token, so the decomposition leaves it out of the kernel figures).
`TrajectoryBatch` pads them into tensors over the scored positions 1..n-1; `micro_batches` cuts a
batch into the learner's (and the worker's scoring) micro-batches.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..envs.custom import finite_number
from ..errors import InputError


def _finite_log_prob(value) -> bool:
    try:
        return math.isfinite(value) and value <= 0.0
    except TypeError:  # (a string was a TypeError naming no response)
        return False


def _first_non_integer(values) -> int | None:
    """The index of the first entry of `values` that is not an integer (a bool is not), or None.
    (A string in policy_versions was a TypeError naming no response; 0.5 was truncated to 0.)"""
    if isinstance(values, torch.Tensor) and not (values.is_floating_point() or values.dtype == torch.bool
                                                 or values.is_complex()):
        return None
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            return i
    return None


@dataclass
class Trajectory:
    token_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    policy_versions: list[int]
    reward: float
    group_id: int
    metadata: dict[str, Any] = field(default_factory=dict)
    rollout_routing: torch.Tensor | None = None
    """MoE models: [n, moe layers, k] int16, the experts the rollout routed the forward that
    produced token t to (-1 where token t was not sampled); None for dense models."""
    sampled_learner_logprobs: list[float] | None = None
    """The learner path's (`sequence_logprobs`) log-prob of token t under the weights that sampled
    it, computed by the rollout worker right after sampling; NaN where not computed. The learner's
    kernel/lag decomposition uses it instead of a kept copy of those weights; None: not computed."""
    cache_versions: list[int] | None = None
    """Per token, the version of the weights that computed the oldest keys/values the forward
    sampling token t attended (-1 where not sampled); below policy_versions[t] after an in-flight
    update that kept the cache. None: every token's cache was its own version's."""
    excluded: str | None = None
    """Why the objective leaves this response out (`from_output`: the engine failed it, e.g. the
    tokenizer could not decode it), or None. It stays in the batch, for the diagnostics, with
    advantage 0; its group's baseline is the mean of the others (a failure outside the policy must
    not push it). So is a response the KV cache ended (`cache_full`: its tokens kept, "length")."""

    @staticmethod
    def from_output(out, reward: float, group_id: int, **metadata) -> Trajectory:
        """From an engine `RequestOutput` (prompt tokens get mask 0, version -1). The rollout
        log-prob μ of a token is the one of the distribution it was drawn from: under top-k /
        top-p that is the truncated one (`sampled_logprobs`), so the importance weights correct
        the truncation too (and the mismatch figures include it); without truncation the two are
        the same numbers."""
        fields = ("prompt_token_ids", "token_ids", "full_token_ids", "loss_mask", "sampled_logprobs",
                  "policy_versions", "routing", "cache_versions", "finish_reason", "request_id")
        missing = [f for f in fields if not hasattr(out, f)]
        if missing:  # (a dict was an AttributeError)
            raise InputError(f"Trajectory.from_output takes an engine RequestOutput, got "
                             f"{type(out).__name__} (no {missing[0]})")
        p = len(out.prompt_token_ids)
        routing = None
        if out.routing is not None:
            shape = next(r for r in out.routing if r is not None).shape
            routing = torch.full((p + len(out.routing), *shape), -1, dtype=torch.int16)
            for t, r in enumerate(out.routing):
                if r is not None:
                    routing[p + t] = r
        cache = None if out.cache_versions is None else [-1] * p + list(out.cache_versions)
        value = finite_number(reward)
        if value is None:  # (None was a bare TypeError, '1' was taken as 1.0)
            raise InputError(f"request {out.request_id}: reward {reward!r} is not a finite number (float32)")
        return Trajectory(out.full_token_ids, [0] * p + list(out.loss_mask),
                          [0.0] * p + list(out.sampled_logprobs), [-1] * p + list(out.policy_versions),
                          value, group_id, dict(metadata), routing, cache_versions=cache,
                          excluded=f"engine error: {out.error}" if out.finish_reason == "error" else
                          f"the KV cache ended it at {p + len(out.token_ids)} tokens (raise "
                          "rollout.kv_cache_memory)" if getattr(out, "cache_full", False) else None)

    def validate(self, index: int) -> None:
        where = f"response {index}"
        n = len(self.token_ids)
        if n < 2:
            raise InputError(f"{where}: token_ids needs at least 2 tokens, has {n}")
        for name in ("loss_mask", "rollout_logprobs", "policy_versions"):
            m = len(getattr(self, name))
            if m != n:
                raise InputError(f"{where}: {name} has {m} entries, token_ids has {n}")
        if any(v not in (0, 1) for v in self.loss_mask):
            raise InputError(f"{where}: loss_mask must hold only 0 and 1")
        if self.loss_mask[0]:
            raise InputError(f"{where}: loss_mask[0] must be 0 (the first token has no log-prob)")
        if sum(self.loss_mask) == 0:
            if self.excluded:  # (the engine refused it, e.g. a prompt too long for the model)
                raise InputError(f"{where}: {self.excluded}, before it sampled a token; leave it out "
                                 f"of the batch")
            raise InputError(f"{where}: loss_mask selects no token")
        for name in ("policy_versions", "cache_versions"):
            bad = None if getattr(self, name) is None else _first_non_integer(getattr(self, name))
            if bad is not None:
                raise InputError(f"{where}: {name}[{bad}] = {getattr(self, name)[bad]!r} is not an integer")
        for t, (m, lp) in enumerate(zip(self.loss_mask, self.rollout_logprobs)):
            if m and not _finite_log_prob(lp):
                raise InputError(f"{where}: rollout_logprobs[{t}] = {lp!r} is not a finite log-prob")
            if m and self.policy_versions[t] < 0:
                raise InputError(f"{where}: policy_versions[{t}] is missing for a sampled token")
        for name in ("sampled_learner_logprobs", "cache_versions"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise InputError(f"{where}: {name} has {len(values)} entries, token_ids has {n}")
        if finite_number(self.reward) is None:  # (NumPy scalars, as envs return them, are numbers)
            raise InputError(f"{where}: reward {self.reward!r} is not a finite number (float32)")
        if isinstance(self.group_id, bool) or not isinstance(self.group_id, numbers.Integral):
            # (a string was int()'s error; 1.7 and 1.2 were both group 1: baselines silently merged)
            raise InputError(f"{where}: group_id must be an integer, got {self.group_id!r}")
        r = self.rollout_routing
        if r is not None and (not isinstance(r, torch.Tensor) or r.dim() != 3 or r.shape[0] != n):
            raise InputError(f"{where}: rollout_routing must be a [{n}, layers, k] tensor")


class TrajectoryBatch:
    """Responses padded into tensors over scored positions (token t+1 for t = 0..n-2).

    Tensors: `mask`, `rollout_logprobs` [B, L] float32, `versions` [B, L] int64 (-1 where
    masked out), `rewards` [B] float32, `group_ids` [B] int64, `sampled_learner_logprobs` [B, L]
    float32 (NaN where the worker did not compute them), `stale_cache` [B, L] bool (sampled tokens
    whose forward read keys/values of an older version than their own) and for MoE models
    `routing` [B, L, moe layers, k] (the rollout's experts; -1 where not recorded).
    """

    def __init__(self, trajectories: Sequence[Trajectory], validate: bool = True):
        if isinstance(trajectories, Trajectory) or not isinstance(trajectories, Sequence) \
                or not all(isinstance(t, Trajectory) for t in trajectories):
            raise InputError(f"TrajectoryBatch takes a list of Trajectory, got {type(trajectories).__name__}"
                             + ("" if not isinstance(trajectories, Sequence) else " holding other things"))
        if not trajectories:
            raise InputError("empty trajectory batch")
        if validate:
            for i, tr in enumerate(trajectories):
                tr.validate(i)
        self.trajectories = list(trajectories)
        bsz = len(trajectories)
        width = max(len(t.token_ids) for t in trajectories) - 1
        self.mask = torch.zeros(bsz, width)
        self.rollout_logprobs = torch.zeros(bsz, width)
        self.versions = torch.full((bsz, width), -1, dtype=torch.long)
        self.sampled_learner_logprobs = torch.full((bsz, width), float("nan"))
        cache = torch.full((bsz, width), -1, dtype=torch.long)
        for i, t in enumerate(trajectories):
            n = len(t.token_ids) - 1
            self.mask[i, :n] = torch.tensor(t.loss_mask[1:], dtype=torch.float32)
            self.rollout_logprobs[i, :n] = torch.tensor(t.rollout_logprobs[1:], dtype=torch.float32)
            self.versions[i, :n] = torch.as_tensor(t.policy_versions[1:])
            if t.sampled_learner_logprobs is not None:
                self.sampled_learner_logprobs[i, :n] = torch.tensor(t.sampled_learner_logprobs[1:],
                                                                    dtype=torch.float32)
            own = t.policy_versions if t.cache_versions is None else t.cache_versions
            cache[i, :n] = torch.as_tensor(own[1:])
        self.versions[self.mask == 0] = -1
        self.stale_cache = (self.mask > 0) & (cache < self.versions)
        self.sampled_learner_logprobs[self.mask == 0] = float("nan")
        self.routing = None  # MoE: [B, L, moe layers, k] rollout experts per scored position
        routed = [t.rollout_routing for t in trajectories if t.rollout_routing is not None]
        if routed:
            self.routing = torch.full((bsz, width, *routed[0].shape[1:]), -1, dtype=torch.int16)
            for i, t in enumerate(trajectories):
                if t.rollout_routing is not None:
                    self.routing[i, :len(t.token_ids) - 1] = t.rollout_routing[1:]
        self.rewards = torch.tensor([float(t.reward) for t in trajectories])
        self.included = torch.tensor([t.excluded is None for t in trajectories])
        self.group_ids = torch.tensor([int(t.group_id) for t in trajectories])

    def __len__(self) -> int:
        return len(self.trajectories)

    @property
    def sequences(self) -> list[list[int]]:
        return [t.token_ids for t in self.trajectories]

    def check_versions(self, learner_version: int, max_lag: int) -> None:
        """Refuse sampled tokens of a version ahead of the learner's (a negative lag) or more than
        `max_lag` behind it (they were trained without the decomposition, past the promised bound)."""
        sampled = self.versions[self.mask > 0]
        if not sampled.numel():
            return
        if (newest := int(sampled.max())) > learner_version:
            raise InputError(f"policy version {newest} in the batch is ahead of the learner's "
                             f"{learner_version}")
        if learner_version - (oldest := int(sampled.min())) > max_lag:
            raise InputError(f"policy version {oldest} in the batch is {learner_version - oldest} behind the "
                             f"learner's {learner_version}, beyond max_policy_lag={max_lag}")

    def select(self, index: Sequence[int], validate: bool = True) -> TrajectoryBatch:
        return TrajectoryBatch([self.trajectories[i] for i in index], validate=validate)

    def pad(self, per_response: Sequence[torch.Tensor]) -> torch.Tensor:
        """Stack per-response vectors of n_i - 1 scored positions into [B, L] (zeros after)."""
        out = torch.zeros(len(self), self.mask.shape[1], dtype=per_response[0].dtype)
        for i, v in enumerate(per_response):
            out[i, :v.numel()] = v
        return out


def pad_routing(batch: TrajectoryBatch, routes: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Per-response routing [n_i - 1, layers, k] stacked into [B, L, layers, k] (-1 after)."""
    if not routes:
        return None
    out = torch.full((len(batch), batch.mask.shape[1], *routes[0].shape[1:]), -1, dtype=torch.int16)
    for i, r in enumerate(routes):
        out[i, :r.shape[0]] = r
    return out


@dataclass
class RolloutBatch:
    """What the rollout worker emits for one learner step: batch `index`'s trajectories, the
    policy version that sampled it (drain mode: every token; in-flight: the first token) and
    rollout-side figures. Crosses process boundaries as itself (pickled whole)."""

    index: int
    trajectories: list[Trajectory]
    version: int
    generate_s: float
    """Seconds spent sampling the batch (environment steps included)."""
    wait_s: float
    """Seconds the worker waited for fresh enough weights before sampling (admission control)."""
    stats: dict[str, float] = field(default_factory=dict)
    """Episode statistics (`rollout/...` keys)."""
    load_s: float = 0.0
    """Seconds the worker paused to load new weights for this batch (in-flight loads included)."""

    def to_dict(self) -> dict:
        """Plain lists, numbers and tensors (what `torch.load(weights_only=True)` reads back)."""
        out = dict(vars(self))
        out["trajectories"] = [dict(vars(t)) for t in self.trajectories]
        return out

    @staticmethod
    def from_dict(data: dict) -> RolloutBatch:
        fields = dict(data)
        fields["trajectories"] = [Trajectory(**t) for t in fields["trajectories"]]
        return RolloutBatch(**fields)


def micro_batches(lengths: list[int], max_seqs: int, max_tokens: int = 0) -> list[list[int]]:
    """Consecutive groups of sequence indices, each of at most `max_seqs` sequences and (when
    `max_tokens` > 0) at most `max_tokens` tokens; a sequence longer than `max_tokens` goes alone."""
    groups: list[list[int]] = []
    tokens = 0
    for i, n in enumerate(lengths):
        if not groups or len(groups[-1]) == max_seqs or (max_tokens and tokens + n > max_tokens):
            groups.append([])
            tokens = 0
        groups[-1].append(i)
        tokens += n
    return groups
