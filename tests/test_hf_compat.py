"""Hugging Face interoperability: what parity saves loads as Qwen3ForCausalLM with the same
logits, and a checkpoint HF writes loads back into parity."""

from __future__ import annotations

import pytest
import torch

import parity

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("tied", [True, False])
def test_transformers_loads_parity_checkpoint_and_agrees(tmp_path, tied):
    model = parity.Model(parity.ModelConfig.preset("tiny", tie_word_embeddings=tied), seed=0)
    model.reset_parameters(0, 0.1)
    model.save_pretrained(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 3, 64, 65, 66]])
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        ours = parity.sequence_logprobs(model, [ids[0]])[0]
    assert torch.allclose(ref, ours, atol=1e-5), (ref - ours).abs().max()
    hf.save_pretrained(tmp_path / "from_hf")
    again = parity.load_model(tmp_path / "from_hf")
    with torch.no_grad():
        assert torch.equal(parity.sequence_logprobs(again, [ids[0]])[0], ours)
