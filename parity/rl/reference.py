"""The reference policy of the learner's KL penalty (`learner.kl_coef`): a frozen copy of the
weights the learner started from, on the same kernels and in the same dtype as the learner's
forward, so at version 0 its log-probs are the learner's bit for bit and the penalty is exactly 0.

A run's checkpoints carry its weights (`state_dict`), so a resumed run keeps the reference it
started with rather than taking the resumed weights for it.
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError
from ..model import sequence_logprobs
from .trajectory import TrajectoryBatch


def cpu_copy(model) -> dict[str, torch.Tensor]:
    """A copy of `model`'s state dict on the CPU, whatever its device (the learner's kept versions,
    the reference's checkpointed weights)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


class ReferencePolicy:
    """π_ref: `logprobs(batch, learner_config)` scores a (micro-)batch as the learner does, without grad."""

    def __init__(self, model):
        self.model = model.twin(model.backend)  # the weights as they are now, the same kernels and dtype
        self.model.requires_grad_(False)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Its weights, on the CPU (what a checkpoint stores)."""
        return cpu_copy(self.model)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)

    def logprobs(self, batch: TrajectoryBatch, cfg) -> torch.Tensor:
        """log π_ref of every scored position [B, L], padded as the batch pads (no grad)."""
        with torch.no_grad():
            return batch.pad(sequence_logprobs(self.model, batch.sequences, cfg.temperature,
                                               head_chunk=cfg.head_rows(self.model.config.vocab_size)))


def restore_reference(reference: ReferencePolicy | None, saved: dict | None, where) -> None:
    """A resume: the checkpoint's reference weights into the learner's (kl_coef > 0), or a
    one-line CheckpointError when the run that saved `where` kept none (it had no KL penalty)."""
    if reference is None:
        return
    if saved is None:
        raise CheckpointError(f"{where} was saved by a run without a KL penalty, so it holds no reference "
                              "policy: resume with learner.kl_coef = 0, or start a new run from it")
    reference.load_state_dict(saved)
