"""Test and benchmark harness: it drives or breaks the product, it is not part of it (none of it ships in the wheel;
``tests/test_packaging.py`` keeps it out of ``rlix_plugins``).

* :mod:`.local_receiver` - ``SubprocessReceiver``, a ``transport.ReceiverEndpoint`` whose workers are spawned
  local processes (fault hooks included: a worker can be told to ``os._exit``). The transport tests and
  ``benchmarks/transport.py`` drive the sender against it.
* :mod:`.chaos` - fault injection on the built-in demo host: the fault matrix (``tests/faults``) and the chaos soak
  (``benchmarks/soak.py``); :mod:`.fault_file` (the armed fault a broken component claims) and
  :mod:`.fault_worker` (the vLLM worker that breaks on demand).

Imported as ``tests.harness.*`` with the repository root on ``sys.path`` (``python -m pytest`` from the root; the
benchmarks put it there). Processes these modules start find them the same way: Ray workers get the driver's
working directory, spawned processes the parent's ``sys.path``, and the chaos engines' ``PYTHONPATH`` names the root
(:data:`ROOT`).
"""

from pathlib import Path

#: The repository root: the directory that makes ``tests.harness`` importable.
ROOT = Path(__file__).resolve().parents[2]
