"""Same-GPU transports by name: the one place a transport is registered.

Adding a transport = a module with a :class:`~rlix_plugins.transport._same_gpu.BucketTransport` or
``SyncTransport`` subclass, plus its line in ``_REGISTERED``. The sender and the receivers look transports up
here and branch on none of their names.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from rlix_plugins.errors import RlixConfigError
from rlix_plugins.transport._cpu_serialize import CpuSerialize
from rlix_plugins.transport._cuda_ipc import CudaIpc
from rlix_plugins.transport._host_pull import HostPull
from rlix_plugins.transport._same_gpu import SameGpuTransport

_REGISTERED: dict[str, SameGpuTransport] = {
    t.name: t
    for t in (
        HostPull(),
        CudaIpc(),
        CpuSerialize(),
    )
}


def registered_transports() -> Mapping[str, SameGpuTransport]:
    """Every registered same-GPU transport by name, in registration order (read-only)."""
    return MappingProxyType(_REGISTERED)


def same_gpu_transport(name: str) -> SameGpuTransport:
    """The transport registered as ``name``; a one-line ``RlixConfigError`` listing the names otherwise."""
    found = _REGISTERED.get(name)
    if found is None:
        raise RlixConfigError(f"same_gpu_transport={name!r} is not a registered transport; use one of {tuple(_REGISTERED)}")
    return found
