"""Several Ray nodes on one machine (``rlix_plugins.control.admin.local_nodes``, what ``rlix demo --nodes`` and the
tests' two-raylet clusters start): the nodes come up at their addresses, and Ray's record of the machine's cluster
(the file a plain ``ray.init()`` joins) is as it was while they run and after they end - Ray's ``Cluster`` wrote its
head there, so another test run's session joined it, and its shutdown deleted the record, whoever's it was. Runs in
a process of its own with Ray's default temp directory in a scratch directory (``RAY_TMPDIR``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rlix_plugins.control.admin.local_nodes import bindable
from tests.harness.cross_node import NODE_B_IP

SCRIPT = r'''
import json, os, sys
import ray
from rlix_plugins.control.admin.local_nodes import start_local_nodes
record = os.path.join(os.environ["RAY_TMPDIR"], "ray", "ray_current_cluster")
def read():
    return open(record).read() if os.path.exists(record) else None
seen = {"before": read()}
nodes = start_local_nodes(2, num_cpus=1, num_gpus=1, resources=[{"a": 1}, {"b": 1}])
seen["running"] = read()
ray.init(address=nodes.address, log_to_driver=False)
seen["nodes"] = sorted((n["NodeManagerAddress"], n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["Alive"])
ray.shutdown()
nodes.end()
seen["after"] = read()
seen["temp_dir_left"] = os.path.exists(nodes.temp_dir)
print(json.dumps(seen))
'''


@pytest.mark.parametrize("recorded", [None, "10.9.8.7:6379"], ids=["no-record", "someone-elses-record"])
def test_nodes_start_at_their_addresses_and_leave_the_machines_record_alone(recorded: str | None) -> None:
    if not bindable(NODE_B_IP):
        pytest.skip(f"{NODE_B_IP} cannot be bound on this machine (Linux routes 127.0.0.0/8 to lo; macOS does not)")
    with tempfile.TemporaryDirectory(prefix="rlix-rt-", dir="/tmp") as scratch:  # short: Ray's socket paths
        if recorded is not None:
            (Path(scratch) / "ray").mkdir()
            (Path(scratch) / "ray" / "ray_current_cluster").write_text(recorded)
        out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "RAY_TMPDIR": scratch})
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["before"] == seen["running"] == seen["after"] == recorded, seen
    assert [ip for ip, _ in seen["nodes"]].count(NODE_B_IP) == 1 and len(seen["nodes"]) == 2, seen
    assert all(gpus == 1 for _, gpus in seen["nodes"]), seen
    assert not seen["temp_dir_left"]

