"""Worker-group dispatch on a real local Ray cluster: ONE_TO_ALL and data-parallel split/concat."""

import sys
import time

import pytest
import ray.cloudpickle
import torch

from agent_trainer.common.batch import TensorBatch
from agent_trainer.workers.worker_group import WorkerGroup, split_for_ranks


class RankEcho:
    """A plain worker: tags each row with its rank."""

    def __init__(self, rank: int, world_size: int, scale: float = 1.0):
        self.rank, self.world_size, self.scale = rank, world_size, scale

    def whoami(self, suffix: str) -> str:
        return f"{self.rank}/{self.world_size}{suffix}"

    def double(self, batch: TensorBatch) -> TensorBatch:
        return TensorBatch({"y": batch["x"] * 2 * self.scale, "rank": torch.full((len(batch),), self.rank)})


# Ray workers cannot import this test module by name; ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_split_for_ranks_pads_evenly():
    batch = TensorBatch({"x": torch.arange(5)})
    shards, pad = split_for_ranks(batch, 2)
    assert pad == 1 and [len(s) for s in shards] == [3, 3]
    assert torch.cat([s["x"] for s in shards]).tolist() == [0, 1, 2, 3, 4, 0]


@pytest.mark.parametrize("rows", [1, 5, 6])
def test_dp_compute_keeps_order_and_drops_padding(ray_cluster, rows):
    group = WorkerGroup(RankEcho, name="echo", world_size=2, num_cpus_per_rank=0.1, init_kwargs={"scale": 1.0})
    try:
        assert group.execute_all("whoami", "!") == ["0/2!", "1/2!"]
        out = group.dp_compute("double", TensorBatch({"x": torch.arange(rows)}))
        assert out["y"].tolist() == [2 * i for i in range(rows)]
        # rank 0 takes the first half, rank 1 the rest
        assert out["rank"].tolist() == sorted(out["rank"].tolist())
        assert set(out["rank"].tolist()) == ({0, 1} if rows > 1 else {0})
    finally:
        group.shutdown()


class Replica:
    """A plain worker without ranks (like a rollout engine)."""

    def pid(self) -> int:
        import os

        return os.getpid()


def test_members_are_named_and_a_restarted_one_keeps_its_name(ray_cluster):
    from ray.exceptions import ActorUnavailableError

    ranks = WorkerGroup(RankEcho, name="named", world_size=2, num_cpus_per_rank=0.1)
    replicas = WorkerGroup(Replica, name="replica", world_size=1, num_cpus_per_rank=0.1, pass_rank=False,
                           max_restarts=1)
    try:
        assert ray.get(ray.get_actor("named_rank1").whoami.remote("")) == "1/2"
        first_pid = ray.get(ray.get_actor("replica_0").pid.remote())
        ray.kill(replicas.workers[0], no_restart=False)  # Ray restarts it (max_restarts=1)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the name answers again, from a new process
            try:
                if ray.get(ray.get_actor("replica_0").pid.remote()) != first_pid:
                    break
            except ActorUnavailableError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("replica_0 did not come back under its name within 60 s")
    finally:
        ranks.shutdown()
        replicas.shutdown()


class PeerFailure:
    """Rank 1 dies; rank 0 fails at once, like a gloo collective whose peer went away."""

    def __init__(self, rank: int, world_size: int):
        self.rank = rank

    def step(self) -> None:
        import os

        if self.rank == 1:
            time.sleep(1.0)  # the survivor's error reaches the driver first
            os._exit(1)
        raise RuntimeError("[gloo] Connection closed by peer")


def test_a_survivors_collective_error_is_reported_as_the_dead_peer(ray_cluster):
    from ray.exceptions import RayTaskError

    from agent_trainer.workers.worker_group import WorkerDied

    group = WorkerGroup(PeerFailure, name="peers", world_size=2, num_cpus_per_rank=0.1)
    try:
        with pytest.raises(WorkerDied, match="peers rank 1"):
            group.execute_all("step")
    finally:
        group.shutdown()
    group = WorkerGroup(RankEcho, name="plain", world_size=2, num_cpus_per_rank=0.1)
    try:  # an error with no dead rank behind it propagates as it is
        with pytest.raises(RayTaskError, match="NoneType"):
            group.get([group.workers[0].double.remote(None), group.workers[1].whoami.remote("")])
    finally:
        group.shutdown()


class Placed:
    """Reports the placement group Ray placed it in."""

    def placement_group_id(self) -> str:
        return ray.get_runtime_context().get_placement_group_id()


def _free_per_bundle(pg) -> list[float]:
    """CPUs still free in each bundle of ``pg`` (Ray's ``CPU_group_<i>_<pg id>`` resources)."""
    free = ray.available_resources()
    return [round(free.get(f"CPU_group_{i}_{pg.id.hex()}", 0.0), 6) for i in range(pg.bundle_count)]


def test_a_guest_group_runs_in_its_hosts_bundles(ray_cluster):
    """actor_rollout_ref.hybrid_engine's placement, for real: guest i (an engine) runs in host rank i's bundle,
    the bundle holds both ranks' CPUs, and removing the host's placement group is left to the host."""
    from ray.util.placement_group import placement_group_table

    host = WorkerGroup(RankEcho, name="host", world_size=2, num_cpus_per_rank=0.1, bundle_extra={"CPU": 0.2})
    try:
        table = placement_group_table(host.placement_group)
        assert [b["CPU"] for b in table["bundles"].values()] == pytest.approx([0.3, 0.3])
        host.execute_all("whoami", "")  # the host's ranks are placed
        assert _free_per_bundle(host.placement_group) == [0.2, 0.2]  # each bundle keeps its guest's share
        one = WorkerGroup(Placed, name="guest", world_size=1, num_cpus_per_rank=0.2, pass_rank=False, host=host)
        assert one.execute_all("placement_group_id") == [host.placement_group.id.hex()]
        assert _free_per_bundle(host.placement_group) == [0.0, 0.2]  # guest 0 took bundle 0's share
        one.shutdown()  # a guest does not remove its host's placement group
        assert placement_group_table(host.placement_group)["state"] == "CREATED"
        assert host.execute_all("whoami", "") == ["0/2", "1/2"]
        two = WorkerGroup(Placed, name="guest", world_size=2, num_cpus_per_rank=0.2, pass_rank=False, host=host)
        two.execute_all("placement_group_id")
        assert _free_per_bundle(host.placement_group) == [0.0, 0.0]
        two.shutdown()
        with pytest.raises(ValueError, match="cannot be placed"):
            WorkerGroup(Placed, name="too_many", world_size=3, num_cpus_per_rank=0.1, pass_rank=False, host=host)
    finally:
        host.shutdown()
