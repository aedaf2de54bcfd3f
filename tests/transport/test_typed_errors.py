"""A receiver's typed error reaches the sender typed, with its fields: through pickling, through real Ray actors
(``RayTaskError``) and through text-only hops (vLLM's ``collective_rpc``); a message that merely names an error
type is never taken for that type (the old ``"WeightVerificationError" in repr(exc)`` test did exactly that)."""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlix_plugins.errors import (
    RlixConfigError,
    TransportError,
    WeightVerificationError,
    carried_in_text,
    typed_error,
)
from rlix_plugins.transport import wait_all

#: what vLLM's multiprocess executor and engine-core client make of a worker's error (only its text survives)
VLLM_TEXT = "Call to collective_rpc method failed: Worker failed with error '{}', please check the stack trace above"


def _mismatch(name: str = "layers.3.weight") -> WeightVerificationError:
    return WeightVerificationError(f"parameter {name!r} differs after loading", parameter=name)


def test_pickling_keeps_type_and_fields() -> None:
    back = pickle.loads(pickle.dumps(WeightVerificationError("m", parameter="w", dp_rank=3)))
    assert type(back) is WeightVerificationError and str(back) == "m"
    assert (back.parameter, back.dp_rank) == ("w", 3)


def test_text_hop_keeps_type_message_and_fields() -> None:
    found = typed_error(Exception(VLLM_TEXT.format(carried_in_text(_mismatch()))))
    assert type(found) is WeightVerificationError
    assert str(found) == "parameter 'layers.3.weight' differs after loading"  # the original message, no tag
    assert found.parameter == "layers.3.weight"


def test_a_name_in_a_message_is_not_a_type() -> None:
    assert typed_error(Exception(VLLM_TEXT.format("WeightVerificationError: parameter 'x' differs"))) is None
    own = TransportError("apply_mode='WeightVerificationError' is not one of ('auto',)")
    assert typed_error(own) is own
    # a tag that does not decode is text like any other
    assert typed_error(Exception("[rlix-error:bm90IGpzb24=] WeightVerificationError: forged")) is None


def test_the_outer_carried_error_wins_over_one_quoted_inside_it() -> None:
    inner = carried_in_text(_mismatch())
    outer = carried_in_text(TransportError(f"broadcast of bucket 2 failed ({inner})"))
    assert type(typed_error(Exception(VLLM_TEXT.format(outer)))) is TransportError
    # an rlix error that quotes a carried one (without being carried itself) is what it is
    quoting = TransportError(f"broadcast of bucket 2 failed ({inner})")
    assert typed_error(quoting) is quoting


def test_carrying_twice_changes_nothing() -> None:
    once = carried_in_text(_mismatch())
    assert carried_in_text(once) is once
    assert type(carried_in_text(RlixConfigError("bad"))) is RlixConfigError


# --------------------------------------------------------------------------------------------- real Ray actors


class _Receiver:
    """Raises what a receiver worker would, from a Ray actor (the engine actors of the real runs)."""

    def verify_model(self, how: str) -> bool:
        bad = WeightVerificationError("parameter 'lm_head.weight' differs after loading", parameter="lm_head.weight")
        if how == "typed":  # an in-process engine: the worker's own exception object reaches the actor
            raise bad
        if how == "carried":  # as the receiver raises it
            raise carried_in_text(bad)
        if how == "vllm_text":  # a multiprocess engine inside the actor: vLLM hands back the text
            raise RuntimeError(VLLM_TEXT.format(carried_in_text(bad)))
        if how == "mentions":  # another failure whose message names the verification error
            raise TransportError("verify_model needs a finalized sync (no WeightVerificationError check ran)")
        if how == "mentions_untyped":
            raise RuntimeError("WeightVerificationError: a plain RuntimeError that only says so")
        if how == "stuck":  # a live receiver waiting in a collective for a peer that died
            time.sleep(20)
        return True


@pytest.fixture(scope="module")
def receiver(ray_cluster: dict) -> Iterator[Any]:
    import ray

    here = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])  # the actor's class
    actor = ray.remote(num_cpus=0)(_Receiver).options(max_concurrency=4, runtime_env={"env_vars": {"PYTHONPATH": here}}).remote()
    yield actor
    ray.kill(actor)


@pytest.mark.parametrize("how", ["typed", "carried", "vllm_text"])
def test_verification_error_crosses_ray_typed_with_its_fields(receiver: Any, how: str) -> None:
    with pytest.raises(WeightVerificationError) as err:
        wait_all({4: receiver.verify_model.remote(how).future()}, 60, "verify_model(version 9)")
    assert type(err.value) is WeightVerificationError
    assert (err.value.parameter, err.value.dp_rank) == ("lm_head.weight", 4)
    assert str(err.value) == "verify_model(version 9): dp rank 4: parameter 'lm_head.weight' differs after loading"


@pytest.mark.parametrize(("how", "text"), [("mentions", "no WeightVerificationError check ran"),
                                           ("mentions_untyped", "a plain RuntimeError that only says so")])
def test_other_failures_crossing_ray_stay_transport_errors(receiver: Any, how: str, text: str) -> None:
    with pytest.raises(TransportError, match=f"dp rank 2 failed: .*{text}") as err:
        wait_all({2: receiver.verify_model.remote(how).future()}, 60, "verify_model(version 9)")
    assert not isinstance(err.value, WeightVerificationError)


def test_a_healthy_receiver_answers(receiver: Any) -> None:
    assert wait_all({0: receiver.verify_model.remote("ok").future()}, 60, "verify_model") == {0: True}


def test_the_first_failure_ends_the_wait_wherever_it_is(receiver: Any) -> None:
    """A rank that failed is reported at once, also behind a live rank still waiting (for the one that failed)."""
    calls = {0: receiver.verify_model.remote("stuck").future(), 1: receiver.verify_model.remote("mentions").future()}
    start = time.monotonic()
    with pytest.raises(TransportError, match="dp rank 1 failed"):
        wait_all(calls, 60, "setup_collective_group(g)")
    assert time.monotonic() - start < 10
