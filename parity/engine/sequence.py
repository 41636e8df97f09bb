"""Requests as the engine sees them: sampling parameters and a growing token sequence.

A `Sequence` holds every token of one request (prompt, sampled tokens, environment tokens),
with per-token `loss_mask`, recorded log-probs and the `policy_version` of the weights that
produced each sampled token. `num_computed` counts the tokens whose keys/values are in the KV
cache; the scheduler feeds the rest (prefill chunks, or the one newest token when decoding).
`cache_version` is the version of the weights that computed the oldest of those keys/values:
a token sampled by newer weights (an in-flight update kept the cache) records it in
`cache_versions`, since no single version's weights sampled it.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

from ..errors import InputError
from ..fields import check_fields, known_keywords
from ..model.logprobs import MIN_TEMPERATURE


@known_keywords(InputError)
@dataclass
class SamplingParams:
    """How to sample one request. Validated on construction."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax, ties to the lower token id; log-probs recorded at
    temperature 1)."""
    max_tokens: int = 64
    """Most tokens to sample for this request (per turn, for multi-turn requests)."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = off; ties to the lower token id)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p (1.0 = off); with top_k,
    of the k tokens' renormalised probabilities (top-k first, as transformers and vLLM do)."""
    seed: int | None = None
    """Per-request seed: the same request, seed and weights give the same tokens in any batch."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Finish when one of these is sampled (it is kept in the output)."""
    stop_strings: list[str] = field(default_factory=list)
    """Finish on the token whose text completes one of these in the turn's text (needs a tokenizer on
    the engine); that token may carry characters past it, and the output is not cut there."""
    ignore_eos: bool = False
    """Do not stop on the model's EOS token."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (the engine checks again when a request is added: a SamplingParams
        changed after construction was sampled with, temperature -1 and all)."""
        if isinstance(self.stop_token_ids, (set, frozenset)):
            self.stop_token_ids = list(self.stop_token_ids)
        check_fields(self, InputError)
        t = self.temperature
        if not (t == 0 or MIN_TEMPERATURE <= t < math.inf):
            raise InputError(f"SamplingParams.temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, inf), "
                             f"got {self.temperature!r}")
        if self.max_tokens <= 0:
            raise InputError(f"SamplingParams.max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.top_k < 0:
            raise InputError(f"SamplingParams.top_k must be >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not all(self.stop_strings):
            raise InputError("SamplingParams.stop_strings must be a list of non-empty strings")
        seed = self.seed
        if seed is not None and not 0 <= seed < 2**63:
            raise InputError(f"SamplingParams.seed must be an integer in 0..2**63-1 or None, got {seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncates(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)


class Status(enum.Enum):
    WAITING = "waiting"  # queued for admission (new, preempted, or a resumed multi-turn request)
    RUNNING = "running"  # holds cache blocks; scheduled every step
    PAUSED = "paused"  # multi-turn: finished a turn, keeps its cache until continued/released
    FINISHED = "finished"


@dataclass(eq=False)  # identity, not field-by-field comparison, in the scheduler's queues
class Sequence:
    request_id: int
    token_ids: list[int]
    params: SamplingParams
    prompt_len: int
    multi_turn: bool = False
    status: Status = Status.WAITING
    num_computed: int = 0
    cache_version: int | None = None  # weights that computed the oldest cached keys/values
    cache_epoch: int = -1  # the scheduler's count of weight loads when its cache started (prefix caching)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # per token; 0.0 where not sampled
    sampled_logprobs: list[float] = field(default_factory=list)  # under the truncated dist
    policy_versions: list[int] = field(default_factory=list)  # per token; -1 where not sampled
    cache_versions: list[int] = field(default_factory=list)  # per token: cache_version when sampled
    routing: list = field(default_factory=list)  # MoE: per token, experts [layers, k] of the forward
    # that produced it (None where not sampled, and for dense models)
    turn_tokens: int = 0  # tokens sampled in the current turn
    finish_reason: str | None = None
    cache_full: bool = False  # the KV cache ended it (its last turn, or the next one did not fit)
    arrival: int = 0
    generator: torch.Generator | None = None
    draws: int = 0  # counter-based draws made so far (the next one's index; sampler.py)
    draw_seed: int | None = None  # the seed the noise is keyed by (params.seed until a reseed)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        self.loss_mask = [0] * n
        self.logprobs = [0.0] * n
        self.sampled_logprobs = [0.0] * n
        self.policy_versions = [-1] * n
        self.cache_versions = [-1] * n
        self.routing = [None] * n
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
            self.draw_seed = self.params.seed

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the KV cache."""
        return len(self.token_ids) - self.num_computed

    def append_sampled(self, token: int, logprob: float, sampled_logprob: float, version: int,
                       routing: torch.Tensor | None = None) -> None:
        self.token_ids.append(token)
        self.routing.append(routing)
        self.loss_mask.append(1)
        self.logprobs.append(logprob)
        self.sampled_logprobs.append(sampled_logprob)
        self.policy_versions.append(version)
        self.cache_versions.append(version if self.cache_version is None else self.cache_version)
        self.turn_tokens += 1

    def turn_tail(self, decode) -> str:
        """The end of this turn's text (`decode`: token ids -> str), long enough to hold any stop
        string that ends in its last token: the tokens before the last one give the longest stop
        string's bytes, not counting the replacement characters a character cut at the window's
        start decodes to, plus 3 for one completed by the last token. Tokens of a byte or more
        (every tokenizer's, but for ids past its vocabulary, which decode to nothing) give that at
        the first window; only the window is copied and decoded, whatever the turn's length."""
        need, total, end = max(len(s.encode("utf-8")) for s in self.params.stop_strings), self.turn_tokens, \
            len(self.token_ids)
        n = min(total, need + 4)
        while n < total and len(decode(self.token_ids[end - n:end - 1]).lstrip("\ufffd").encode("utf-8")) \
                < need + 3:
            n = min(total, 2 * n)
        return decode(self.token_ids[end - n:])

    def append_environment(self, tokens: list[int]) -> None:
        self.token_ids.extend(tokens)
        self.loss_mask.extend([0] * len(tokens))
        self.logprobs.extend([0.0] * len(tokens))
        self.sampled_logprobs.extend([0.0] * len(tokens))
        self.policy_versions.extend([-1] * len(tokens))
        self.cache_versions.extend([-1] * len(tokens))
        self.routing.extend([None] * len(tokens))


@dataclass
class RequestOutput:
    """What `Engine.generate` returns per request. Per-token lists cover the whole sequence."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]  # completion: everything after the prompt (sampled + environment)
    logprobs: list[float]  # float32 log-prob of each completion token (0.0 for env tokens)
    sampled_logprobs: list[float]  # under the truncated distribution (= logprobs if none)
    policy_versions: list[int]  # per completion token (-1 for environment tokens)
    loss_mask: list[int]  # per completion token: 1 sampled, 0 environment
    finish_reason: str | None  # "length", "stop", "eos", "error", or None while paused
    error: str | None = None
    text: str | None = None
    routing: list | None = None  # MoE: per completion token, experts [layers, k] (None: not sampled)
    cache_versions: list[int] | None = None  # per completion token: the version of the oldest
    # keys/values it attended (< its policy version after an in-flight update; -1 for env tokens)
    cache_full: bool = False  # ended ("length") by the whole KV cache, not max_tokens or the
    # context, or a next turn did not fit it: a sizing limit (the RL objective leaves it out)

    @property
    def full_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.token_ids

    @staticmethod
    def from_sequence(seq: Sequence) -> RequestOutput:
        p = seq.prompt_len
        routing = seq.routing[p:] if any(r is not None for r in seq.routing[p:]) else None
        return RequestOutput(seq.request_id, seq.token_ids[:p], seq.token_ids[p:], seq.logprobs[p:],
                             seq.sampled_logprobs[p:], seq.policy_versions[p:], seq.loss_mask[p:],
                             seq.finish_reason, routing=routing, cache_versions=seq.cache_versions[p:],
                             cache_full=seq.cache_full)
