"""Losing a Ray node mid-run: its actors and the batches they finished but the learner had not
taken in yet (their objects live in that node's store) are sampled again on a node that replaces
it, and the deterministic run's metrics are those of a run that lost nothing (one restart of the
budget for the node, however many actors it had); with no node to
replace it, the run stops after `ray.placement_timeout_s` with an error saying what is missing.

In its own module: it starts a cluster of its own in this process, which test_ray.py's shared
instance would be in the way of.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import ray
from ray.cluster_utils import Cluster

from parity.config import load_config
from parity.errors import ParityError
from parity.metrics.summary import deterministic_view
from parity.rl import checkpoint
from parity.rl.controller import Controller

BASE = ["model.preset=\"tiny\"", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_tokens=8",
        "learner.lr=0.003", "learner.micro_batch_size=4", "task.targets=[7, 8]", "steps=8",
        "max_policy_lag=2", "deterministic=true", "eval_every=0"]

# Every return value goes to the store of the node that made it (none is small enough to travel
# inline with the reply), and a dead node is declared dead within about a second.
SYSTEM = {"max_direct_call_object_size": 1, "health_check_period_ms": 200,
          "health_check_failure_threshold": 3, "health_check_initial_delay_ms": 0}


@contextlib.contextmanager
def two_nodes(monkeypatch, doomed_cpus: int = 1):
    """A head of one CPU and a second node of `doomed_cpus` (one actor per CPU), and the config's
    extras for one actor per CPU."""
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):  # a private head's token mode, set by an earlier
        monkeypatch.delenv(var, raising=False)     # test: Ray read the mode (none) on import
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "_system_config": SYSTEM})
    try:
        doomed = cluster.add_node(num_cpus=doomed_cpus)
        yield cluster, doomed, ["rollout.backend=\"ray\"", f"rollout.workers={1 + doomed_cpus}",
                                "ray.cpus_per_worker=1", f"ray.address=\"{cluster.address}\""]
    finally:
        ray.shutdown()
        cluster.shutdown()


def actors_on(run: Controller, node) -> list[int]:
    return [i for i, a in enumerate(run.rollout.actors) if ray.get(a.node.remote()) == node.node_id]


def test_a_lost_node_s_unconsumed_batches_are_sampled_again(tmp_path, monkeypatch, caplog):
    """Three actors, two on the doomed node. After step 0 each of those two finishes a batch the
    learner has not seen finish (batches 1-3, the ones weights 0 and 1 admit, are held back until
    the test lets them go) and the node is killed at once: those batches' only copies go with it.
    They are sampled again by replacement actors on a new node, and the two restarts of one lost
    node count once against the restart budget (here cut to 1). Before, the learner stopped with
    Ray's ObjectReconstructionFailedError; a node of 4 actors would then have used up the budget."""
    whole = Controller(load_config(None, BASE + [f"run_dir=\"{tmp_path / 'whole'}\""])).run()
    (tmp_path / "state").mkdir()
    gate = tmp_path / "go"
    monkeypatch.setenv("PARITY_FAULTS", ",".join(f"worker-hold@{b}:{gate}" for b in (1, 2, 3)))
    monkeypatch.setenv("PARITY_FAULT_STATE", str(tmp_path / "state"))
    with two_nodes(monkeypatch, doomed_cpus=2) as (cluster, doomed, extras):
        run = Controller(load_config(None, BASE + [f"run_dir=\"{tmp_path / 'ray'}\"", *extras]))
        lost: list[int] = []

        def lose_the_node(step, metrics):
            if step != 0:
                return
            rollout = run.rollout
            rollout.budget.limit = 1
            on_it = actors_on(run, doomed)
            assert len(on_it) == 2, "two actors on the doomed node"
            held = {b: ref for b, ref in rollout.pending.items() if b <= 3 and b % rollout.n in on_it}
            assert len(held) == 2 and not ray.wait(list(held.values()), num_returns=2, timeout=0,
                                                   fetch_local=False)[0]
            gate.touch()
            # finished, and not fetched here: their only copies are in the doomed node's store
            ready, _ = ray.wait(list(held.values()), num_returns=2, timeout=120, fetch_local=False)
            assert len(ready) == 2, "the held batches never finished"
            cluster.remove_node(doomed, allow_graceful=False)
            cluster.add_node(num_cpus=2)  # the replacement node
            lost.extend(held)

        with caplog.at_level("WARNING"):
            metrics = run.run(progress=lose_the_node)
        assert len(lost) == 2 and run.rollout.restarts == 2
        assert f"lost batch {min(lost)} (ObjectReconstructionFailedError) with its node" in caplog.text
        assert deterministic_view(metrics) == deterministic_view(whole)  # nothing lost or repeated


def test_a_lost_node_with_no_room_left_for_its_actor_is_a_one_line_error(tmp_path, monkeypatch, caplog):
    """No node replaces the lost one: the replacement actor cannot be placed. It was judged hung
    once its start-up grace ran out (2 minutes), replaced, and so on three times; now the run stops
    when ray.placement_timeout_s has passed, saying what it needs, with the steps trained saved."""
    with two_nodes(monkeypatch) as (cluster, doomed, extras):
        run = Controller(load_config(None, BASE + [f"run_dir=\"{tmp_path}\"", *extras, "steps=30",
                                                   "ray.placement_timeout_s=3"]))
        lost_at: list[float] = []

        def lose_the_node(step, metrics):
            if step == 1:
                assert len(actors_on(run, doomed)) == 1
                cluster.remove_node(doomed, allow_graceful=False)
                lost_at.append(time.monotonic())

        with pytest.raises(ParityError, match=r"rollout actor \d found no Ray node with 1 CPU free in 3 s "
                                              r"\(ray.placement_timeout_s; the cluster has 0 CPU free\)"):
            run.run(progress=lose_the_node)
        assert time.monotonic() - lost_at[0] < 60
    assert "waits for a Ray node with 1 CPU free" in caplog.text
    saved = checkpoint.latest(tmp_path)  # the steps trained before the batch that never came
    checkpoint.verify(saved)
    step = int(saved.name.split("-")[1])
    assert step >= 2 and f"the rollout failed at batch {step}" in caplog.text
