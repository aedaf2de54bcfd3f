"""Multi-process weight sync on CPU: a sender (this process) and three receiver processes.

dp0 sits on the sender's "GPU" (cpu_serialize), dp1 and dp2 on other devices (gloo broadcast over a
group created and destroyed per sync). Real torch.distributed, real processes, no mocks. All on this machine and
without Ray: the plans say node 0 (the check against the receivers' places refuses another node number here), and
the rendezvous address is given (there is no Ray node IP to default to).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import torch

from rlix_plugins.errors import TransportError, WeightVerificationError
from rlix_plugins.transport import VersionedBucketCache, build_comm_plan, sync_weights
from rlix_plugins.transport import _sender as sender_mod
from tests.harness.local_receiver import SubprocessReceiver

BUCKET = 32 << 10
PLAN = build_comm_plan((0, 0), {0: [(0, 0)], 1: [(0, 1)], 2: [(0, 2)]}, "cpu_serialize")
LOOPBACK = "127.0.0.1"


def _model(version: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + version)
    out = [(f"layers.{i}.weight", torch.randn(64, 33 + i, generator=g).to(torch.bfloat16)) for i in range(12)]
    out += [
        ("norm.weight", torch.randn(127, generator=g)),
        ("embed.weight", torch.randn(120, 64, generator=g)),  # 30720 bytes: a bucket of its own
        ("step", torch.tensor(version, dtype=torch.int64)),
        ("mask", torch.rand(37, generator=g) > 0.5),
        ("empty", torch.zeros(0, 5)),
    ]
    return out


class HostSpy(sender_mod.GroupHost):
    """Records every sender-side group host (to check that ports and groups are released)."""

    created: list[HostSpy] = []

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        HostSpy.created.append(self)


@pytest.fixture(autouse=True)
def spy_hosts(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    HostSpy.created = []
    monkeypatch.setattr(sender_mod, "GroupHost", HostSpy)
    yield


@pytest.fixture(scope="module")
def receivers() -> Iterator[dict[int, SubprocessReceiver]]:
    eps = {dp: SubprocessReceiver(("cpu",)) for dp in (0, 1, 2)}
    yield eps
    for ep in eps.values():
        ep.close()


def _port_free(port: int) -> bool:
    """Nobody listens on ``port`` any more (connections in TIME_WAIT are fine)."""
    with socket.socket() as s:
        s.settimeout(2)
        if s.connect_ex(("127.0.0.1", port)) == 0:
            return False
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _assert_nothing_left(eps: dict[int, SubprocessReceiver]) -> None:
    for host in HostSpy.created:
        assert host._pg is None and host._store is None
        assert _port_free(host.port), f"sender port {host.port} still bound"
    for dp, ep in eps.items():
        if ep.alive():
            assert ep.call_worker(0, "state").result(10)["groups"] == [], f"dp {dp} kept a group"


def _assert_bit_exact(ep: SubprocessReceiver, model: list[tuple[str, torch.Tensor]]) -> None:
    got = ep.call_worker(0, "tensors").result(30)
    assert set(got) == {n for n, _ in model}
    for name, t in model:
        dtype, shape, raw = got[name]
        assert (dtype, shape) == (str(t.dtype).removeprefix("torch."), list(t.shape)), name
        assert raw == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), name


def test_several_sync_cycles_are_bit_exact(receivers: dict[int, SubprocessReceiver]) -> None:
    cache = VersionedBucketCache(BUCKET)
    for version in range(3):
        model = _model(version)
        cache.build(version, iter(model))
        report = sync_weights(cache, PLAN, receivers, master_addr=LOOPBACK, timeout_s=20, verify=True)
        assert report.version == version and report.num_buckets >= 3 and report.verified
        assert report.ipc_dp_ranks == (0,) and report.broadcast_dp_ranks == (1, 2)
        for ep in receivers.values():
            _assert_bit_exact(ep, model)
        _assert_nothing_left(receivers)
    assert len({h.port for h in HostSpy.created}) == 3 and len({h.name for h in HostSpy.created}) == 3


def test_same_gpu_only_plan_needs_no_group(receivers: dict[int, SubprocessReceiver]) -> None:
    cache = VersionedBucketCache(BUCKET)
    model = _model(7)
    cache.build(7, iter(model))
    plan = build_comm_plan((0, 0), {0: [(0, 0)]}, "cpu_serialize")
    report = sync_weights(cache, plan, {0: receivers[0]}, master_addr=LOOPBACK, timeout_s=20, verify=True)
    assert report.group_name is None and not HostSpy.created
    _assert_bit_exact(receivers[0], model)


def test_verification_names_the_corrupted_parameter(receivers: dict[int, SubprocessReceiver]) -> None:
    cache = VersionedBucketCache(BUCKET)
    cache.build(11, iter(_model(11)))
    sync_weights(cache, PLAN, receivers, master_addr=LOOPBACK, timeout_s=20)
    with cache.read() as snap:
        expected = snap.checksums
    receivers[2].call_worker(0, "corrupt", "layers.3.weight").result(10)
    with pytest.raises(WeightVerificationError, match=r"'layers\.3\.weight' differs"):
        receivers[2].verify_model(expected).result(10)
    receivers[1].verify_model(expected).result(10)


def test_receiver_dying_mid_sync_fails_cleanly_and_next_sync_works(receivers: dict[int, SubprocessReceiver]) -> None:
    cache = VersionedBucketCache(BUCKET)
    cache.build(20, iter(_model(20)))
    receivers[1].call_worker(0, "fail_on", "broadcast_parameter", 2).result(10)
    timeout_s = 4.0
    start = time.monotonic()
    with pytest.raises(TransportError, match="dp rank 1"):
        sync_weights(cache, PLAN, receivers, master_addr=LOOPBACK, timeout_s=timeout_s)
    elapsed = time.monotonic() - start
    assert elapsed < 3 * timeout_s, f"failed sync took {elapsed:.1f} s"
    assert not receivers[1].alive()
    _assert_nothing_left(receivers)
    with cache.read(0.5) as snap:  # the lock was released
        assert snap.version == 20

    receivers[1].close()
    receivers[1] = SubprocessReceiver(("cpu",))
    model = _model(21)
    cache.build(21, iter(model))
    report = sync_weights(cache, PLAN, receivers, master_addr=LOOPBACK, timeout_s=20, verify=True)
    assert report.version == 21
    for ep in receivers.values():
        _assert_bit_exact(ep, model)
    _assert_nothing_left(receivers)


def test_receiver_that_cannot_join_fails_the_sync_at_once(receivers: dict[int, SubprocessReceiver]) -> None:
    """A receiver whose setup call fails (its engine died) ends the sync when it fails, not after ``timeout_s``:
    the sender waits for every receiver to arrive before its own part of the rendezvous, which cannot be cut short.
    (A real NeMo RL run whose vLLM EngineCore was SIGKILLed waited out its 180 s sync bound here, on an H200.)"""
    cache = VersionedBucketCache(BUCKET)
    cache.build(30, iter(_model(30)))
    dead = SubprocessReceiver(("cpu",))
    dead.call_worker(0, "fail_on", "setup_collective_group", 1).result(10)
    plan = build_comm_plan((0, 0), {1: [(0, 1)], 3: [(0, 3)]}, "cpu_serialize")
    start = time.monotonic()
    with pytest.raises(TransportError, match=r"0 of 2 receivers arrived|1 of 2 receivers arrived") as info:
        sync_weights(cache, plan, {1: receivers[1], 3: dead}, master_addr=LOOPBACK, timeout_s=60.0)
    assert time.monotonic() - start < 10, "the sync waited out its bound for a receiver that had failed"
    assert "dp rank 3" in str(info.value)
    dead.close()
    _assert_nothing_left(receivers)
    model = _model(31)
    cache.build(31, iter(model))
    sync_weights(cache, PLAN, receivers, master_addr=LOOPBACK, timeout_s=20, verify=True)
    _assert_bit_exact(receivers[1], model)


# ---- host_pull: receivers map the sender's shared cache pages and copy from them ---------------------------

HOST_PULL_PLAN = build_comm_plan((0, 0), {0: [(0, 0)], 1: [(0, 1)], 2: [(0, 2)]}, "host_pull")


def test_host_pull_next_to_broadcast_is_bit_exact_over_versions(receivers: dict[int, SubprocessReceiver]) -> None:
    cache = VersionedBucketCache(BUCKET)
    assert cache.shared
    try:
        for version in (30, 31):
            model = _model(version)
            cache.build(version, iter(model))
            report = sync_weights(cache, HOST_PULL_PLAN, receivers, master_addr=LOOPBACK, timeout_s=20, verify=True)
            assert report.ipc_dp_ranks == (0,) and report.broadcast_dp_ranks == (1, 2) and report.verified
            for ep in receivers.values():
                _assert_bit_exact(ep, model)
        _assert_nothing_left(receivers)
    finally:
        cache.close()


def test_host_pull_reads_what_the_cache_holds_and_verification_catches_a_flipped_byte(
    receivers: dict[int, SubprocessReceiver],
) -> None:
    cache = VersionedBucketCache(BUCKET)
    plan = build_comm_plan((0, 0), {0: [(0, 0)]}, "host_pull")
    try:
        cache.build(40, iter(_model(40)))
        with cache.read() as snap:  # corrupt the cache's bytes after the sender's checksums were taken
            record = snap.buckets[1]
            victim = record.meta.names[0]
            record.buffer[record.meta.offsets[0]] ^= 0x10
        with pytest.raises(WeightVerificationError, match=victim.replace(".", r"\.")):
            sync_weights(cache, plan, {0: receivers[0]}, master_addr=LOOPBACK, timeout_s=20, verify=True)
    finally:
        cache.close()


def test_host_pull_errors_name_the_fix(receivers: dict[int, SubprocessReceiver]) -> None:
    from rlix_plugins.transport import map_host_buffer

    with pytest.raises(TransportError, match="another machine"):
        map_host_buffer({"boot_id": "elsewhere", "pid": 1, "fd": 3, "inode": 1, "nbytes": 8}, pin=False)
    from rlix_plugins.transport._host_pull import BOOT_ID

    with pytest.raises(TransportError, match="cuda_ipc"):  # a sender that is gone
        map_host_buffer({"boot_id": BOOT_ID, "pid": 2**22 + 7, "fd": 3, "inode": 1, "nbytes": 8}, pin=False)
    unshared = VersionedBucketCache(BUCKET, shared=False)
    unshared.build(0, iter(_model(0)))
    with pytest.raises(TransportError, match="shared host memory"):
        sync_weights(unshared, build_comm_plan((0, 0), {0: [(0, 0)]}, "host_pull"), {0: receivers[0]}, timeout_s=5)
