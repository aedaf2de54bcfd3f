"""Receiver-side group API guards (no peers needed): no-op destroy, clear errors before any collective."""

from __future__ import annotations

import pytest

from rlix_plugins.errors import RlixConfigError, TransportError
from rlix_plugins.transport import (
    broadcast_parameter,
    destroy_collective_group,
    group_names,
    pack_bucket,
    receive_bucket,
    setup_collective_group,
)


def test_destroy_of_a_group_never_joined_is_a_noop() -> None:
    assert destroy_collective_group("rlix_sync_never_joined") is False
    assert "rlix_sync_never_joined" not in group_names()


def test_broadcast_without_setup_names_the_group() -> None:
    meta = pack_bucket([]).meta.to_wire()
    with pytest.raises(TransportError, match="no group 'missing'"):
        broadcast_parameter("missing", meta)


def test_setup_rejects_bad_rank_and_backend_before_connecting() -> None:
    with pytest.raises(RlixConfigError, match="rank 0 is the sender"):
        setup_collective_group("g", "127.0.0.1", 1, 0, 2, "gloo", 1.0)
    with pytest.raises(RlixConfigError, match="not one of"):
        setup_collective_group("g", "127.0.0.1", 1, 1, 2, "mpi", 1.0)
    with pytest.raises(RlixConfigError, match="needs a CUDA device"):
        setup_collective_group("g", "127.0.0.1", 1, 1, 2, "nccl", 1.0, device="cpu")


def test_setup_to_a_closed_port_fails_within_the_timeout() -> None:
    with pytest.raises(TransportError, match="could not join group 'g'"):
        setup_collective_group("g", "127.0.0.1", 1, 1, 2, "gloo", 1.0)
    assert "g" not in group_names()


def test_unknown_payload_transport_is_rejected() -> None:
    with pytest.raises(TransportError, match="unknown payload transport 'zmq'"):
        receive_bucket({"transport": "zmq"})
