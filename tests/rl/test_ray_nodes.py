"""Losing a Ray node mid-run: its actors and the batches they finished but the learner had not
taken in yet (their objects live in that node's store) are sampled again on a node that replaces
it, and the deterministic run's metrics are those of a run that lost nothing.

In its own module: it starts a cluster of its own in this process, which test_ray.py's shared
instance would be in the way of.
"""

from __future__ import annotations

import ray
from ray.cluster_utils import Cluster

from parity.config import load_config
from parity.metrics.summary import deterministic_view
from parity.rl.controller import Controller

BASE = ["model.preset=\"tiny\"", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_tokens=8",
        "learner.lr=0.003", "learner.micro_batch_size=4", "task.targets=[7, 8]", "steps=8",
        "max_policy_lag=2", "deterministic=true", "eval_every=0"]

# Every return value goes to the store of the node that made it (none is small enough to travel
# inline with the reply), and a dead node is declared dead within about a second.
SYSTEM = {"max_direct_call_object_size": 1, "health_check_period_ms": 200,
          "health_check_failure_threshold": 3, "health_check_initial_delay_ms": 0}


def test_a_lost_node_s_unconsumed_batches_are_sampled_again(tmp_path, monkeypatch):
    """After step 0 the actor on the doomed node finishes a batch the learner has not seen
    finish (a fault holds batches 2 and 3 back 5 s, so there is one) and the node is killed at
    once: that batch's only copy goes with it. It is sampled again by a replacement actor on a
    new node. Before, the learner stopped with Ray's ObjectReconstructionFailedError."""
    whole = Controller(load_config(None, BASE + [f"run_dir=\"{tmp_path / 'whole'}\""])).run()
    (tmp_path / "state").mkdir()
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):  # a private head's token mode, set by an earlier
        monkeypatch.delenv(var, raising=False)     # test: Ray read the mode (none) on import
    monkeypatch.setenv("PARITY_FAULTS", "worker-slow@2:5,worker-slow@3:5")
    monkeypatch.setenv("PARITY_FAULT_STATE", str(tmp_path / "state"))
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "_system_config": SYSTEM})
    try:
        doomed = cluster.add_node(num_cpus=1)
        cfg = load_config(None, BASE + [f"run_dir=\"{tmp_path / 'ray'}\"", "rollout.backend=\"ray\"",
                                        "rollout.workers=2", "ray.cpus_per_worker=1",
                                        f"ray.address=\"{cluster.address}\""])
        run = Controller(cfg)
        lost: list[int] = []

        def lose_the_node(step, metrics):
            if step != 0:
                return
            rollout = run.rollout
            on_it = [i for i, a in enumerate(rollout.actors) if ray.get(a.node.remote()) == doomed.node_id]
            assert len(on_it) == 1, "one actor per node"
            # its first batch not finished when the learner last looked (so no copy was asked for)
            batch = min(b for b, ref in rollout.pending.items() if b % rollout.n == on_it[0]
                        and not ray.wait([ref], timeout=0, fetch_local=False)[0])
            # then finished, and not fetched here: its only copy is in the doomed node's store
            ready, _ = ray.wait([rollout.pending[batch]], timeout=120, fetch_local=False)
            assert ready, f"batch {batch} never finished"
            cluster.remove_node(doomed, allow_graceful=False)
            cluster.add_node(num_cpus=1)  # the replacement node
            lost.append(batch)

        metrics = run.run(progress=lose_the_node)
        assert lost and run.rollout.restarts == 1
        assert deterministic_view(metrics) == deterministic_view(whole)  # nothing lost or repeated
    finally:
        ray.shutdown()
        cluster.shutdown()
