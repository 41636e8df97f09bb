"""Sampler: greedy, temperature, top-k and top-p sampling that no other request can perturb.

Each request samples from its own row with its own generator (Gumbel-max over the row's
log-probs), so the same seed and weights give the same token alone or in a busy batch. It records
the float32 log-prob under the temperature-scaled full distribution (exactly what
`sequence_logprobs` computes), and, when top-k/top-p truncate, the log-prob under the
distribution actually sampled from.
"""

from __future__ import annotations

import torch

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
        out: list[tuple[int, float, float] | None] = [None] * len(seqs)
        tokens = torch.empty(len(seqs), dtype=torch.long)
        temps = [s.params.temperature if not s.params.greedy else 1.0 for s in seqs]
        truncated_lp: dict[int, float] = {}
        for i, s in enumerate(seqs):
            row = logits[i:i + 1]
            if s.params.greedy:
                tokens[i] = int(torch.argmax(row[0].float()))
                continue
            logp = kernels.log_softmax(row, s.params.temperature)[0]
            if s.params.truncates:
                keep = _keep_mask(logp, s.params.top_k, s.params.top_p)
                logp_s = logp.masked_fill(~keep, float("-inf"))
            else:
                logp_s = logp
            u = torch.rand(logp.shape, generator=self._generator(s), dtype=torch.float64)
            gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
            tok = int(torch.argmax(logp_s.double() + gumbel))
            tokens[i] = tok
            if s.params.truncates:
                norm = torch.logsumexp(logp_s.double(), 0)
                truncated_lp[i] = float(logp[tok].double() - norm)
        # the recorded log-prob: the same kernel and row bits as sequence_logprobs
        for t in sorted(set(temps)):
            idx = [i for i, x in enumerate(temps) if x == t]
            sel = torch.tensor(idx)
            lp = kernels.token_logprobs(logits[sel], tokens[sel], t)
            for j, i in enumerate(idx):
                v = float(lp[j])
                out[i] = (int(tokens[i]), v, truncated_lp.get(i, v))
        return out  # type: ignore[return-value]
