"""Shared placement (reference F12) on Ray with declared GPUs: one placement group per GPU shared by two pipelines,
fractional workers of both pipelines in one bundle on the same GPU, unique worker names, the adapter's surface."""

from __future__ import annotations

import pytest
import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlix_plugins.errors import RlixConfigError
from rlix_plugins.nemo_rl.placement import VirtualClusterAdapter, placement_pool, worker_name_prefix


@ray.remote(num_cpus=0)
class _Worker:
    def gpu(self) -> list[int]:
        return [int(g) for g in ray.get_gpu_ids()]


def test_two_pipelines_share_per_gpu_groups(ray_cluster: dict[str, float]) -> None:
    pool = placement_pool()
    try:
        first = ray.get(pool.groups.remote([0, 1]), timeout=180)
        again = ray.get(placement_pool().groups.remote([1, 0]), timeout=60)  # another driver: same actor, same groups
        assert {g: pg.id for g, pg in first.items()} == {g: pg.id for g, pg in again.items()}

        workers, names = [], set()
        for pid in ("ft_aaaaaaaaaaaa", "ft_bbbbbbbbbbbb"):
            adapter = VirtualClusterAdapter([first[0], first[1]], max_colocated_worker_groups=4, name=pid)
            assert adapter.world_size() == 2 and adapter._init_placement_groups() == adapter.get_placement_groups()
            for rank, pg in enumerate(adapter.get_placement_groups()):
                name = f"{worker_name_prefix(pid, 'policy')}-{rank}"
                names.add(name)
                workers.append(_Worker.options(
                    name=name, num_gpus=1 / adapter.max_colocated_worker_groups,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                         placement_group_bundle_index=0)).remote())
        gpus = ray.get([w.gpu.remote() for w in workers], timeout=120)
        assert gpus == [[0], [1], [0], [1]]  # both pipelines' rank r on GPU r, inside the shared group
        assert len(names) == 4
        addrs = adapter.get_available_addresses_and_ports_batch([(0, 0), (1, 0)])
        assert len({port for _, port in addrs}) == 2 and adapter.shutdown() is True
        with pytest.raises(RlixConfigError, match="cross-node"):
            adapter._init_placement_groups(use_unified_pg=True)
        for w in workers:
            ray.kill(w)
    finally:
        ray.get(pool.release_all.remote(), timeout=60)
        ray.kill(pool)
