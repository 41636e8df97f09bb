"""Sampler: greedy, temperature, top-k and top-p sampling that no other request can perturb.

Each request samples from its own row with its own noise (Gumbel-max over the row's log-probs),
so the same seed and weights give the same token alone or in a busy batch. It records the float32
log-prob under the temperature-scaled full distribution (exactly what `sequence_logprobs`
computes), and, when top-k/top-p truncate, the log-prob under the distribution actually sampled
from. Where the noise comes from (`draws`): on a CPU from each request's CPU generator; on a GPU
from counter-based uniforms made on the device (`draws.py`: a hash of the request's key and draw
index, the same bits on any device), so the step's sampling stays where the logits are and only
the chosen tokens and their log-probs cross to the host.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from . import draws as counter
from .sequence import Sequence

DRAWS = ("auto", "generator", "counter")
"""Noise sources: 'auto' (counter-based on a GPU, per-request CPU generators elsewhere),
'generator', 'counter'."""


_TRITON_SAMPLE: list = []


def _triton_sample():
    """`draws_triton` (the fused Triton draw), or None where Triton cannot be imported (looked up once)."""
    if not _TRITON_SAMPLE:
        try:
            from . import draws_triton
        except (ImportError, ConfigError):
            draws_triton = None
        _TRITON_SAMPLE.append(draws_triton)
    return _TRITON_SAMPLE[0]


_UNSEEDED = 0x5EED0F0E4C1E7A11  # (a tag: unseeded requests' noise apart from any caller's seed)


def _keep_mask(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Boolean mask of the tokens top-k / top-p keep, from a row of log-probs [V]: top-k first,
    then top-p over the k kept tokens' renormalised mass (as transformers and vLLM compose them)."""
    order = torch.argsort(logp, descending=True, stable=True)
    keep_sorted = torch.ones_like(order, dtype=torch.bool)
    if top_k > 0:
        keep_sorted[top_k:] = False
    if top_p < 1.0:
        probs = logp[order].double().exp() * keep_sorted
        before = probs.cumsum(0) - probs  # mass of strictly more likely kept tokens
        keep_sorted &= before < top_p * probs.sum()
    keep = torch.zeros_like(keep_sorted)
    keep[order] = keep_sorted
    return keep


class Sampler:
    def __init__(self, model, seed: int = 0, draws: str = "auto"):
        if draws not in DRAWS:
            raise ConfigError(f"draws must be one of {', '.join(map(repr, DRAWS))}, got {draws!r}")
        self.model = model
        self.seed = seed
        self.draws = draws

    def _seed(self, seq: Sequence) -> int:
        """The request's seed; unseeded: still deterministic per (engine seed, request), a 64-bit
        hash of both, so no small seed a caller picks draws its noise (`seed * 1_000_003 + id`
        gave request r of engine seed 0 the noise of `SamplingParams(seed=r)`)."""
        if seq.draw_seed is not None:
            return seq.draw_seed
        return counter.mix_int(counter.mix_int(self.seed ^ _UNSEEDED) + seq.request_id)

    def _generator(self, seq: Sequence) -> torch.Generator:
        if seq.generator is None:
            seq.generator = torch.Generator().manual_seed(self._seed(seq))
        return seq.generator

    def rewind(self, marks: list[tuple[Sequence, int]], vocab: int) -> None:
        """Put each request's noise back to where it stood after `draws` draws (a step that failed
        part-way is run again with the same noise): counter draws by the count, a CPU generator
        by replaying its draws from its seed (only on such a failure; nothing on the way)."""
        for s, draws in marks:
            if s.draws == draws:
                continue
            s.draws = draws
            if s.generator is not None:
                g = torch.Generator().manual_seed(self._seed(s))
                for _ in range(draws):
                    torch.rand(vocab, generator=g, dtype=torch.float64)
                s.generator = g

    def _draw_keys(self, seqs: list[Sequence], device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's counter-draw key and draw number (int64 [n] on `device`); counts the draw."""
        keys = torch.tensor([counter.request_key(self._seed(s)) for s in seqs], dtype=torch.long)
        counts = torch.tensor([s.draws for s in seqs], dtype=torch.long)
        for s in seqs:
            s.draws += 1
        return keys.to(device), counts.to(device)

    def _fused_draws(self, logp: torch.Tensor) -> bool:
        """Whether counter draws for these rows run as one Triton pass (`draws_triton.py`):
        on a GPU, with counter draws, where Triton is installed. Same tokens as the PyTorch ops."""
        return logp.is_cuda and self.draws != "generator" and _triton_sample() is not None

    def _gumbel_argmax(self, seqs: list[Sequence], sub: torch.Tensor) -> torch.Tensor:
        """argmax(sub + Gumbel noise) per row [len(seqs)], each row's noise its request's own:
        counter-based off the CPU (or when asked; in row chunks, so a GPU holds a few [rows, V]
        float64 temporaries, not a batch's), else each request's CPU generator. Gumbel-max samples
        exactly from softmax(sub)."""
        kernels, vocab = self.model.kernels, sub.shape[1]

        def gumbel(u: torch.Tensor) -> torch.Tensor:
            return kernels.pointwise(lambda x: -torch.log(-torch.log(x)), u.clamp_min(1e-300))

        if sub.device.type == "cpu" and self.draws != "counter":
            u = torch.stack([torch.rand(vocab, generator=self._generator(s), dtype=torch.float64)
                             for s in seqs])
            for s in seqs:
                s.draws += 1  # (`rewind` replays this many)
            return torch.argmax(sub + gumbel(u), dim=-1)
        keys, counts = self._draw_keys(seqs, sub.device)
        rows = max(1, counter.CHUNK // max(1, vocab))
        return torch.cat([torch.argmax(sub[r:r + rows] + gumbel(counter.uniforms(keys[r:r + rows],
                                                                               counts[r:r + rows], vocab)),
                                       dim=-1) for r in range(0, len(seqs), rows)])

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[tuple[int, float, float]]:
        """(token, logprob, sampled_logprob) per sequence. logits [N, V] in the model dtype.

        The recorded log-prob is read from the kernels' `log_softmax` row, which holds the same
        bits as their `token_logprobs` (the learner's `sequence_logprobs`) for every token."""
        kernels = self.model.kernels
        out: list[tuple[int, float, float]] = [(0, 0.0, 0.0)] * len(seqs)
        params = [s.params for s in seqs]
        greedy_of = [p.greedy for p in params]
        cut_of = [p.truncates for p in params]
        temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy_of)]
        # where the sampling math runs: with the logits for counter-based draws, else on the CPU
        on_device = logits.device.type != "cpu" and self.draws != "generator"
        where = logits.device if on_device else torch.device("cpu")
        for t in sorted(set(temps)):
            idx = [i for i, x in enumerate(temps) if x == t]
            rows = logits if len(idx) == len(seqs) else logits[idx]  # no copy when one temperature
            logp = kernels.log_softmax(rows, t).to(where)  # [n_t, V] float32, rows independent
            noisy = [j for j, i in enumerate(idx) if not greedy_of[i]]
            greedy = [j for j, i in enumerate(idx) if greedy_of[i]]
            chosen = torch.zeros(len(idx), dtype=torch.long, device=where)
            if greedy:  # the most likely token (noisy rows get theirs below)
                chosen[greedy] = torch.argmax(rows[greedy].float(), dim=-1).to(where)
            truncated: dict[int, float] = {}
            if noisy and self._fused_draws(logp):  # untruncated rows: one fused pass, no [n, V] temporaries
                plain = [j for j in noisy if not cut_of[idx[j]]]
                if len(plain) == len(idx):  # every row (the usual RL batch): no gathers
                    keys, counts = self._draw_keys([seqs[i] for i in idx], logp.device)
                    chosen = _triton_sample().gumbel_argmax(logp, keys, counts)
                elif plain:
                    keys, counts = self._draw_keys([seqs[idx[j]] for j in plain], logp.device)
                    chosen[plain] = _triton_sample().gumbel_argmax(logp[plain], keys, counts)
                noisy = [j for j in noisy if cut_of[idx[j]]]
            if noisy:
                sub, cut, dropped = logp[noisy].double(), [], []
                for r, j in enumerate(noisy):
                    if cut_of[idx[j]]:
                        p = params[idx[j]]
                        drop = ~_keep_mask(sub[r], p.top_k, p.top_p)
                        sub[r] = sub[r].masked_fill(drop, float("-inf"))
                        cut.append((r, j))
                        dropped.append(drop.any())
                picked = self._gumbel_argmax([seqs[idx[j]] for j in noisy], sub)
                chosen[noisy] = picked
                if cut:  # one transfer for all truncated rows, not one per row
                    vals = torch.stack([sub[r, picked[r]] - torch.logsumexp(sub[r], 0) for r, _ in cut])
                    vals, any_dropped = torch.stack([vals, torch.stack(dropped).double()]).tolist()
                    # (a top-k/top-p that keeps every token: the row's own float32 log-prob)
                    truncated = {j: v for (_, j), v, d in zip(cut, vals, any_dropped) if d}
            lp = logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1).tolist()
            tokens = chosen.tolist()  # one transfer each, not one per row
            for j, i in enumerate(idx):
                out[i] = (tokens[j], lp[j], truncated.get(j, lp[j]))
        return out
