"""The vLLM worker's start under the start-up grant (``vllm.start``): a rendezvous port free after the wait."""

from __future__ import annotations


def test_an_engine_past_the_gate_gets_a_port_free_now() -> None:
    """The rendezvous port vLLM picked before the wait may be taken meanwhile (another pipeline's engine): the port
    handed to the worker after the grant binds, though the old one is held."""
    import socket

    from rlix_plugins.vllm.start import fresh_tcp_port

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("", 0))
        taken.listen()
        old = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        new = fresh_tcp_port(old)
        assert new.startswith("tcp://127.0.0.1:") and new != old
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", int(new.rpartition(":")[2])))
    assert fresh_tcp_port("file:///tmp/x") == "file:///tmp/x"
