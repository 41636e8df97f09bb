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
        """(token, logprob, sampled_logprob) per sequence. logits [N, V] in the model dtype.

        The recorded log-prob is read from the kernels' `log_softmax` row, which holds the same
        bits as their `token_logprobs` (the learner's `sequence_logprobs`) for every token."""
        kernels = self.model.kernels
        out: list[tuple[int, float, float]] = [(0, 0.0, 0.0)] * len(seqs)
        temps = [1.0 if s.params.greedy else float(s.params.temperature) for s in seqs]
        for t in sorted(set(temps)):
            idx = [i for i, x in enumerate(temps) if x == t]
            # [n_t, V] float32, rows independent; the draws happen on the CPU (per-request CPU
            # generators: the same tokens for the same seeds on any device)
            logp = kernels.log_softmax(logits[idx], t).cpu()
            noisy = [j for j, i in enumerate(idx) if not seqs[i].params.greedy]
            chosen = torch.argmax(logits[idx].float(), dim=-1).cpu()
            truncated: dict[int, float] = {}
            if noisy:
                sub = logp[noisy].double()
                for r, j in enumerate(noisy):
                    p = seqs[idx[j]].params
                    if p.truncates:
                        sub[r] = sub[r].masked_fill(~_keep_mask(sub[r], p.top_k, p.top_p), float("-inf"))
                # each request draws its own uniforms; Gumbel-max samples exactly from softmax
                u = torch.stack([torch.rand(sub.shape[1], generator=self._generator(seqs[idx[j]]),
                                            dtype=torch.float64) for j in noisy])
                gumbel = kernels.pointwise(lambda x: -torch.log(-torch.log(x)), u.clamp_min(1e-300))
                picked = torch.argmax(sub + gumbel, dim=-1)
                chosen[noisy] = picked
                for r, j in enumerate(noisy):
                    if seqs[idx[j]].params.truncates:
                        truncated[j] = float(sub[r, picked[r]] - torch.logsumexp(sub[r], 0))
            lp = logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1).tolist()
            for j, i in enumerate(idx):
                out[i] = (int(chosen[j]), lp[j], truncated.get(j, lp[j]))
        return out
