"""A real vLLM-CPU engine on Ray node B (127.0.0.2) receives weights from a cache owner on node A over the per-sync
gloo broadcast, through the product path (``sync_engines`` over ``RayEngineRpc``, rendezvous on the sender's Ray node
IP, the engine's workers reporting their place from vLLM's engine core, which learns its Ray node from the actor).

One two-raylet cluster for the module (``tests.harness.cross_node.two_nodes``), one engine (~1-2 GiB, tens of
seconds on two cores). The transport-level cases (both directions, the loopback dial) are in
``tests/transport/test_cross_node.py``; here the engine end.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rlix_vllm_helpers import BUCKET_BYTES, HERE, KV_CACHE_BYTES

from rlix_plugins.errors import RlixConfigError
from rlix_plugins.vllm import EXTENSION_CLS
from rlix_plugins.vllm.driver import RayEngineRpc
from tests.harness.cross_node import NODE_B_IP, EngineSender, on_node, two_nodes

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.own_cluster]
ray = pytest.importorskip("ray")
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, weight_sets: dict) -> Iterator[dict[str, Any]]:
    from rlix_plugins.vllm.engine_actor import RlixEngineActor

    with two_nodes():
        env = {"RLIX_CONTROL_PLANE": "rlix", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        llm_kwargs = {"model": str(tiny_model_dir), "dtype": "bfloat16", "max_model_len": 128, "max_num_seqs": 8,
                      "enforce_eager": True, "seed": 0, "kv_cache_memory_bytes": KV_CACHE_BYTES, "block_size": 32,
                      "worker_extension_cls": EXTENSION_CLS}
        engine = ray.remote(RlixEngineActor).options(**on_node("b"), runtime_env={"env_vars": env}).remote(llm_kwargs)
        ray.get(engine.pid.remote(), timeout=300)
        sender = ray.remote(EngineSender).options(**on_node("a")).remote(weight_sets["seed1"], BUCKET_BYTES)
        yield {"engine": engine, "sender": sender, "params": len(weight_sets["seed1"])}
        ray.kill(engine)


def test_an_engine_on_node_b_takes_a_broadcast_from_node_a(cluster: dict[str, Any]) -> None:
    rpc = RayEngineRpc(cluster["engine"])
    place = rpc.call("rlix_report_place", ()).result(timeout=60)[0]
    assert place["node_ip"] == NODE_B_IP and place["node_id"]  # the engine core knows its Ray node
    out = ray.get(cluster["sender"].sync.remote((0, 0), {0: [(1, 0)]}, "host_pull", {0: rpc}, TIMEOUT_S),
                  timeout=TIMEOUT_S * 8)
    assert out["rendezvous"] != NODE_B_IP and out["broadcast"] == (0,) and out["finalized"] == (0,)
    assert out["verified"] == {0: [cluster["params"]]}  # every parameter's checksum compared in the engine


def test_a_cross_node_host_pull_into_the_engine_is_refused(cluster: dict[str, Any]) -> None:
    with pytest.raises(RlixConfigError, match=r"runs on 127\.0\.0\.2 .* by host_pull.* cannot cross nodes"):
        ray.get(cluster["sender"].sync.remote((0, 0), {0: [(0, 0)]}, "host_pull",
                                              {0: RayEngineRpc(cluster["engine"])}, TIMEOUT_S), timeout=TIMEOUT_S * 4)
