"""The same-GPU transport registry: lookup by name, one-line errors, and a transport added by registration alone
(one class plus one registry entry) carried by the unchanged sender and ``receive_bucket``."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from rlix_plugins.errors import RlixConfigError, RlixTimeoutError, TransportError, WeightVerificationError
from rlix_plugins.transport import (
    BucketMeta,
    BucketRecord,
    BucketTransport,
    SyncTransport,
    VersionedBucketCache,
    _registry,
    build_comm_plan,
    compute_checksums,
    local_place,
    receive_bucket,
    registered_transports,
    same_gpu_transport,
    sync_weights,
    unpack_bucket,
    verify_checksums,
)

MODEL = [(f"w{i}", torch.randn(40, 8 + i).to(torch.bfloat16)) for i in range(6)] + [("n", torch.arange(7.0))]


def test_the_registered_transports_and_their_shapes() -> None:
    assert tuple(registered_transports()) == ("host_pull", "cuda_ipc", "cpu_serialize")
    assert isinstance(same_gpu_transport("host_pull"), SyncTransport)
    assert isinstance(same_gpu_transport("cuda_ipc"), BucketTransport) and same_gpu_transport("cuda_ipc").reads_staging
    assert isinstance(same_gpu_transport("cpu_serialize"), BucketTransport)
    assert not same_gpu_transport("cpu_serialize").reads_staging
    assert all(t.name == name for name, t in registered_transports().items())


def test_an_unknown_name_is_one_line_listing_the_registered_ones() -> None:
    for call in (lambda: same_gpu_transport("nvlink"), lambda: build_comm_plan((0, 0), {0: [(0, 0)]}, "nvlink")):
        with pytest.raises(RlixConfigError) as err:
            call()
        assert "\n" not in str(err.value)
        assert "'nvlink'" in str(err.value) and all(repr(n) in str(err.value) for n in registered_transports())


def test_receive_bucket_refuses_payloads_it_cannot_open() -> None:
    with pytest.raises(TransportError, match=r"unknown payload transport 'nvlink'; expected one of \('cuda_ipc', 'cpu_serialize'\)"):
        receive_bucket({"transport": "nvlink"})
    with pytest.raises(TransportError, match="unknown payload transport 'host_pull'"):  # a whole-sync payload
        receive_bucket({"transport": "host_pull", "buckets": []})


def test_the_package_imports_neither_vllm_nemo_rl_ray_nor_the_test_endpoints() -> None:
    code = ("import sys\nfor m in ('vllm', 'nemo_rl', 'ray'): sys.modules[m] = None\n"
            "import rlix_plugins.transport, rlix_plugins.errors\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tests'))")  # the harness (tests.harness)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]"


# ------------------------------------------------------------- a transport added by registration alone


class _BytesCopy(BucketTransport):
    """Per bucket: the bytes in the payload, under its own tag."""

    name = "test_bytes_copy"

    def payload(self, record: BucketRecord, data: torch.Tensor) -> dict[str, Any]:
        return {"transport": self.name, "meta": record.meta.to_wire(), "data": record.payload.numpy().tobytes()}

    def receive(self, payload: dict[str, Any], device: torch.device | str, *, scratch_bytes: int) -> list[tuple[str, torch.Tensor]]:
        buffer = torch.frombuffer(bytearray(payload["data"]), dtype=torch.uint8)
        return unpack_bucket(BucketMeta.from_wire(payload["meta"]), buffer)


class _WholeSyncCopy(SyncTransport):
    """Every bucket's bytes in one payload."""

    name = "test_whole_sync_copy"

    def payload(self, records: Sequence[BucketRecord], *, deferred: bool = False,
                overlaps_wake: bool = False) -> dict[str, Any]:
        return {"transport": self.name,
                "buckets": [{"meta": r.meta.to_wire(), "data": r.payload.numpy().tobytes()} for r in records]}


class _InProcessEndpoint:
    """A ``ReceiverEndpoint`` in this process (so it sees this test's registrations): same-GPU calls only."""

    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}
        self.calls = 0

    def _done(self, value: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        fut.set_result(value)
        return fut

    def update_parameter_in_bucket(self, payload: dict[str, Any], ipc_local_ranks: list[int]) -> Future[Any]:
        self.calls += 1
        if isinstance(same_gpu_transport(payload["transport"]), SyncTransport):
            for bucket in payload["buckets"]:
                self._load(_BytesCopy().receive({"transport": _BytesCopy.name, **bucket}, "cpu", scratch_bytes=0))
        else:
            self._load(receive_bucket(payload))
        return self._done(len(self.loaded))

    def _load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.loaded.update((name, t.clone()) for name, t in named)

    def verify_model(self, expected_checksums: dict[str, list[int]]) -> Future[Any]:
        verify_checksums(expected_checksums, compute_checksums(list(self.loaded.items())))
        return self._done(True)

    def report_places(self) -> Future[Any]:
        return self._done([local_place("cpu").to_wire()])  # in this process: where the sender is

    def setup_collective_group(self, *args: Any) -> Future[Any]:
        raise AssertionError("a same-GPU-only plan needs no group")

    broadcast_parameter = destroy_collective_group = setup_collective_group


@pytest.fixture()
def registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for transport in (_BytesCopy(), _WholeSyncCopy()):
        monkeypatch.setitem(_registry._REGISTERED, transport.name, transport)  # the one registry line
    yield


@pytest.mark.parametrize(("name", "calls"), [(_BytesCopy.name, "one per bucket"), (_WholeSyncCopy.name, "one")])
def test_a_registered_transport_carries_a_sync_bit_exact(registered: None, name: str, calls: str) -> None:
    cache = VersionedBucketCache(4096, shared=False)
    cache.build(5, iter(MODEL))
    endpoint = _InProcessEndpoint()
    report = sync_weights(cache, build_comm_plan((0, 0), {0: [(0, 0)]}, name), {0: endpoint}, timeout_s=10, verify=True)
    assert report.verified and report.ipc_dp_ranks == (0,) and report.num_buckets > 1
    assert endpoint.calls == (report.num_buckets if calls == "one per bucket" else 1)
    assert all(torch.equal(endpoint.loaded[key], tensor) for key, tensor in MODEL)


class _FinishingEndpoint(_InProcessEndpoint):
    """Also ends a sync in one call (``sync_weights(finish=True)``), noting whether the cache was still locked."""

    def __init__(self, cache: VersionedBucketCache) -> None:
        super().__init__()
        self.cache = cache
        self.finishes: list[tuple[bool, bool]] = []  # (cache locked, verified)

    def finish(self, expected_checksums: Any) -> Future[Any]:
        try:
            with self.cache.read(timeout_s=0.05):
                locked = False
        except RlixTimeoutError:
            locked = True
        self.finishes.append((locked, expected_checksums is not None))
        if expected_checksums is not None:
            try:
                verify_checksums(expected_checksums, compute_checksums(list(self.loaded.items())))
            except WeightVerificationError as exc:  # the receiver's error arrives with the reply
                failed: Future[Any] = Future()
                failed.set_exception(exc)
                return failed
        return self._done({"finalized": True})


def test_finish_ends_each_target_in_one_call_under_the_cache_lock(registered: None) -> None:
    """``finish=True``: one call per target after the transfer, while the cache lock still guards the pages (a
    deferred host_pull reads them until it returns); verification happens in it, never a second time; its errors
    keep the verification's name. ``after_issue`` needs it (it is the barrier), and so do endpoints."""
    cache = VersionedBucketCache(4096, shared=False)
    cache.build(5, iter(MODEL))
    plan = build_comm_plan((0, 0), {0: [(0, 0)]}, _WholeSyncCopy.name)
    endpoint = _FinishingEndpoint(cache)
    woken: list[bool] = []
    report = sync_weights(cache, plan, {0: endpoint}, timeout_s=10, verify=True, finish=True,
                          after_issue=lambda: woken.append(True))
    assert endpoint.finishes == [(True, True)] and woken == [True] and endpoint.calls == 1
    assert report.finished == {0: {"finalized": True}} and report.verified
    sync_weights(cache, plan, {0: endpoint}, timeout_s=10, verify=False, finish=True)
    assert endpoint.finishes[-1] == (True, False)
    endpoint.loaded["n"] = endpoint.loaded["n"] + 1  # what the next finish verifies differs
    endpoint.update_parameter_in_bucket = lambda *a: endpoint._done(0)  # type: ignore[method-assign]
    with pytest.raises(WeightVerificationError, match=r"^verify_model\(version 5\): dp rank 0: parameter 'n'") as err:
        sync_weights(cache, plan, {0: endpoint}, timeout_s=10, verify=True, finish=True)
    assert (err.value.parameter, err.value.dp_rank) == ("n", 0)
    with pytest.raises(RlixConfigError, match="needs finish=True"):
        sync_weights(cache, plan, {0: endpoint}, timeout_s=10, after_issue=lambda: None)
    with pytest.raises(RlixConfigError, match="dp ranks \\[0\\] have none"):
        sync_weights(cache, plan, {0: _InProcessEndpoint()}, timeout_s=10, finish=True)
