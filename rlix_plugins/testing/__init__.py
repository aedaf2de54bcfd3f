"""Test and benchmark endpoints, not product API: nothing in the core package imports this subpackage.

* :mod:`rlix_plugins.testing.local_receiver` - ``SubprocessReceiver``, a ``transport.ReceiverEndpoint`` whose
  workers are spawned local processes (fault hooks included: a worker can be told to ``os._exit``). The
  transport tests and ``benchmarks/transport.py`` drive the sender against it.
"""
