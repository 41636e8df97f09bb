"""`device` through the stack: explicit CPU gives the same bits as the default, and a GPU that
this torch build cannot see is a one-line error from the Model, the trainer config and the CLI.
(The CUDA runs themselves are `scripts/gpu_check.sh` on a machine with a GPU.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import parity
from parity import hardware
from parity.config import load_config
from parity.errors import ConfigError
from parity.model.batch import ForwardBatch

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def test_explicit_cpu_gives_the_same_bits_as_the_default():
    cfg = parity.ModelConfig.preset("tiny")
    seqs = [[1, 2, 3, 4, 5], [9, 8, 7]]
    a = parity.Model(cfg, seed=4)
    b = parity.Model(cfg, seed=4, device="cpu")
    assert b.device == torch.device("cpu") and b.kernels is a.kernels
    with torch.no_grad():
        for x, y in zip(parity.sequence_logprobs(a, seqs), parity.sequence_logprobs(b, seqs)):
            assert torch.equal(x, y)
    outs = parity.Engine(b, max_num_seqs=2).generate(
        seqs, parity.SamplingParams(max_tokens=4, seed=1, ignore_eos=True))
    ref = parity.Engine(a, max_num_seqs=2).generate(
        seqs, parity.SamplingParams(max_tokens=4, seed=1, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.logprobs for o in outs] == [o.logprobs for o in ref]


def test_forward_batch_moves_once():
    fb = ForwardBatch.build([[1, 2, 3]], [0], 32)
    assert fb.to(torch.device("cpu")) is fb


@pytest.mark.parametrize("bad", ["tpu", "cuda:x", "gpu"])
def test_a_malformed_device_is_named(bad):
    with pytest.raises(ConfigError, match="must be 'cpu', 'cuda' or 'cuda:N'"):
        hardware.check_device(bad, "model.device")


@no_cuda
def test_cuda_without_a_gpu_is_one_line_everywhere():
    with pytest.raises(ConfigError, match=r"device='cuda' but this torch build sees no CUDA device"):
        parity.Model(parity.ModelConfig.preset("tiny"), device="cuda")
    with pytest.raises(ConfigError, match=r"model.device='cuda:1' but this torch build"):
        load_config(None, ["model.device=cuda:1"])
    proc = subprocess.run([sys.executable, "-m", "parity.cli", "bench", "kernels", "--device", "cuda"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    want = ("parity: error: --device='cuda' but this torch build sees no CUDA device "
            f"(torch {torch.__version__})")
    assert proc.stderr.strip().splitlines() == [want]


def test_the_config_records_the_device():
    assert load_config(None, ["model.device=cpu"]).model.device == "cpu"


def test_ray_actors_reserve_gpus_for_a_cuda_model():
    """Ray hides the GPUs from an actor that reserves none, so a CUDA model's rollout actors ask
    for them: one each where the cluster has enough, else a share of one; none on the CPU."""
    pytest.importorskip("ray")
    from types import SimpleNamespace

    from parity.config.train import RaySection
    from parity.rl.ray_cluster import actor_gpus

    def on_cuda(**ray):  # a validated config would refuse cuda on this machine
        return SimpleNamespace(model=SimpleNamespace(device="cuda"), ray=RaySection(**ray))

    cpu, cuda = load_config(None, []), on_cuda()
    assert actor_gpus(cpu, 2, 8) == 0.0
    assert actor_gpus(cuda, 2, 1) == 0.5 and actor_gpus(cuda, 2, 4) == 1.0
    assert actor_gpus(on_cuda(gpus_per_worker=0.25), 2, 1) == 0.25
    with pytest.raises(ConfigError, match="has 0 GPUs"):
        actor_gpus(cuda, 1, 0)
    with pytest.raises(ConfigError, match="gpus_per_worker must be > 0"):
        load_config(None, ["ray.gpus_per_worker=0"])
