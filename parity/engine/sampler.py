"""Sampler: greedy, temperature, top-k and top-p sampling that no other request can perturb.

Each request samples from its own row with its own generator (Gumbel-max over the row's
log-probs), so the same seed and weights give the same token alone or in a busy batch. It records
the float32 log-prob under the temperature-scaled full distribution (exactly what
`sequence_logprobs` computes), and, when top-k/top-p truncate, the log-prob under the
distribution actually sampled from.
"""

from __future__ import annotations

import torch

from ..ops.aligned import pointwise
from .sequence import Sequence


def _keep_mask(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Boolean mask of the tokens top-k / top-p keep, from a row of log-probs [V]."""
    order = torch.argsort(logp, descending=True, stable=True)
    keep_sorted = torch.ones_like(order, dtype=torch.bool)
    if top_k > 0:
        keep_sorted[top_k:] = False
    if top_p < 1.0:
        probs = logp[order].double().exp()
        before = probs.cumsum(0) - probs  # mass of strictly more likely tokens
        keep_sorted &= before < top_p
    keep = torch.zeros_like(keep_sorted)
    keep[order] = keep_sorted
    return keep


class Sampler:
    def __init__(self, model, seed: int = 0):
        self.model = model
        self.seed = seed

    def _generator(self, seq: Sequence) -> torch.Generator:
        if seq.generator is None:  # unseeded: still deterministic per (engine seed, request)
            seq.generator = torch.Generator().manual_seed(self.seed * 1_000_003 + seq.request_id)
        return seq.generator

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[tuple[int, float, float]]:
        """(token, logprob, sampled_logprob) per sequence. logits [N, V] in the model dtype."""
        kernels = self.model.kernels
        n = len(seqs)
        tokens = torch.empty(n, dtype=torch.long)
        temps = [1.0 if s.params.greedy else float(s.params.temperature) for s in seqs]
        truncated_lp: dict[int, float] = {}
        greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
        if greedy:
            tokens[greedy] = torch.argmax(logits[greedy].float(), dim=-1)
        for t in sorted({temps[i] for i, s in enumerate(seqs) if not s.params.greedy}):
            idx = [i for i, s in enumerate(seqs) if not s.params.greedy and temps[i] == t]
            logp = kernels.log_softmax(logits[idx], t).double()  # [n_t, V], rows independent
            for j, i in enumerate(idx):
                p = seqs[i].params
                if p.truncates:
                    logp[j] = logp[j].masked_fill(~_keep_mask(logp[j], p.top_k, p.top_p), float("-inf"))
            # each request draws its own uniforms; Gumbel-max samples exactly from softmax
            u = torch.stack([torch.rand(logp.shape[1], generator=self._generator(seqs[i]),
                                        dtype=torch.float64) for i in idx])
            gumbel = pointwise(lambda x: -torch.log(-torch.log(x)), u.clamp_min(1e-300))
            chosen = torch.argmax(logp + gumbel, dim=-1)
            tokens[idx] = chosen
            for j, i in enumerate(idx):
                if seqs[i].params.truncates:
                    norm = torch.logsumexp(logp[j], 0)
                    truncated_lp[i] = float(logp[j, chosen[j]] - norm)
        out: list[tuple[int, float, float]] = [(0, 0.0, 0.0)] * n
        # the recorded log-prob: the same kernel and row bits as sequence_logprobs
        for t in sorted(set(temps)):
            idx = [i for i, x in enumerate(temps) if x == t]
            lp = kernels.token_logprobs(logits[idx], tokens[idx], t)
            for j, i in enumerate(idx):
                v = float(lp[j])
                out[i] = (int(tokens[i]), v, truncated_lp.get(i, v))
        return out
