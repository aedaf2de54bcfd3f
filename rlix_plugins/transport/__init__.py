"""Weight transport: versioned CPU bucket cache, a registry of same-GPU transports, per-sync broadcast, comm plan,
verification.

What the package offers: the bucket format and the sender's cache (training side), ``build_comm_plan`` and
``sync_weights`` (push one cache version to a set of receivers), the receiver functions a worker calls, and
the transport registry. Everything public is re-exported here (``__all__``); the ``_modules`` are private.
The test endpoint (``SubprocessReceiver``) is test harness, outside the package (``tests/harness``).

Imports torch only (never NeMo RL, vLLM or Ray). This docstring is the contract between the sender
(training side, ``rlix_plugins.nemo_rl``) and the receiver (the vLLM worker extension,
``rlix_plugins.vllm``). Everything that crosses a process boundary is plain Python (str, int, float,
lists, dicts) or ``bytes`` - vLLM's msgpack rejects ``torch.dtype``.

Bucket format
-------------
``BucketMeta(names, shapes, dtypes, offsets, used_bytes, index)``: dtypes are strings
(``"bfloat16"``, ``"float8_e4m3fn"``, ``"bool"``...), offsets are multiples of ``ALIGN_BYTES`` (512),
``used_bytes`` is the end of the last tensor. ``meta.to_wire()`` / ``BucketMeta.from_wire(d)``
convert to/from a plain dict. ``BucketRecord(meta, buffer)`` adds the contiguous uint8 buffer.
``iter_buckets(named_tensors, bucket_size_bytes)`` packs any iterator of ``(name, tensor)``;
``unpack_bucket(meta, buffer)`` returns zero-copy views. A tensor larger than the bucket travels alone in a
bucket of its own, sized to it; tensors are never split.

Cache (sender side)
-------------------
``VersionedBucketCache(bucket_size_bytes, is_owner=...)``; ``cache.build(version, named_tensors)`` on
every training rank (only the owner keeps buckets; pinned buffers allocated once and reused, one replaced
only when a later version's bucket at its index needs more);
``with cache.read(timeout_s) as snap:`` holds the single cache lock (a build takes the same lock),
``snap.version``, ``snap.buckets``, ``snap.checksums``. At most one model copy of host memory.

Comm plan
---------
``build_comm_plan(sender=(node, gpu), targets={dp_rank: [(node, gpu), ...]}, same_gpu_transport)``:
devices equal to the sender's go by the named same-GPU transport, the rest join a broadcast group
(sender rank 0, then ascending ``(dp_rank, local_rank)``). ``TargetPlan.ipc_local_ranks``,
``TargetPlan.broadcast_rank_map()`` (local rank -> group rank), ``TargetPlan.devices`` (the pairs it was built from).

Places (where the processes really run)
---------------------------------------
``local_place(device)`` -> ``Place`` (Ray node id and IP where known, machine boot id, hostname, device, physical
GPU UUID): every receiver endpoint answers ``report_places()`` with one per worker. ``sync_weights`` checks the plan
against them first (``check_comm_plan``): a same-GPU transport to a worker on another node or GPU, a broadcast to a
worker on the sender's GPU, or node numbers that disagree with the nodes are refused (``RlixConfigError`` naming the
target, both places and the fix) before anything is sent. ``export_node_env()``: a Ray process hands its node to
the child processes it starts (vLLM's engine core), which have no Ray of their own.

Same-GPU transports (registry)
------------------------------
``same_gpu_transport(name)`` -> the registered ``SameGpuTransport`` (an unknown name is a one-line
``RlixConfigError`` listing ``registered_transports()``): ``host_pull`` (a ``SyncTransport``: one payload
naming every bucket of the sync, the receiver copies from the sender's shared pinned cache pages),
``cuda_ipc`` and ``cpu_serialize`` (``BucketTransport``: one payload per bucket; ``reads_staging`` marks
cuda_ipc, whose payload points into the sender's GPU staging copy). Adding one: a module with a subclass
and one line in ``_registry``. The sender branches on the two shapes, never on a name.

Sender
------
``sync_weights(cache, plan, endpoints, staging_device=..., master_addr=None, timeout_s=..., verify=..., finish=...)
-> SyncReport``::

    report_places + check_comm_plan -> lock cache -> setup group (only if broadcast targets) -> per bucket: stage -> send -> barrier
    -> destroy (failure: sender first, then receivers; success: all ranks at once, each teardown
    is local) -> [finish on every target] -> unlock -> [verify_model on every target, without finish]

``finish=True`` (endpoints are ``FinishingEndpoint``): one last call per target, still under the lock, makes
the weights served and verifies them (one round trip instead of finalize + verify); a host_pull then returns
once its copies are queued and the finish call is the barrier on the host pages.

``endpoints`` maps dp rank -> an object satisfying ``ReceiverEndpoint`` (a ``typing.Protocol``;
methods return a ``PendingCall`` i.e. anything with ``.result(timeout)`` such as a
``concurrent.futures.Future`` or ``ray.ObjectRef.future()``) and must have SENT the request before
returning: the sender blocks in a collective right after. After a failed sync no group, port or
staging buffer is left behind, and ``TransportError`` (``RlixTimeoutError`` for timeouts) is raised.

Receiver side (what the vLLM worker extension calls, in each worker process)
------------------------------------------------------------------------------
One endpoint = one DP rank (an engine); its workers have local ranks 0..tp-1 and act only when
their local rank is listed (``ipc_local_ranks`` / ``broadcast_local_ranks`` / ``ranks_by_local_rank``).

* ``local_place(device).to_wire()`` - what ``report_places`` answers per worker.
* ``setup_collective_group(group_name, master_addr, master_port, rank, world_size, backend, timeout_s, device=None)``
  - join the per-sync group at the sender's rendezvous address (``rendezvous_address``: the sender's Ray node IP,
  where the group's store listens and nowhere else) (``backend`` "nccl" or "gloo"); blocks until all joined (bounded).
* ``open_host_pull(bucket, pin=)`` -> ``(meta, host_view)`` for each entry of a ``host_pull`` payload's
  ``"buckets"`` (all buckets of a sync in one ``update_parameter_in_bucket`` call): a CPU view of the
  sender's pinned cache pages, mapped once per process; copy from it before the RPC returns.
  ``device_view(host_view, device)``: the same pages as a CUDA tensor, for kernels that read them with the SMs
  (the payload's ``"overlaps_wake"`` asks for that: a wake keeps the copy engines busy).
* ``receive_bucket(payload, device)`` -> ``[(name, tensor)]`` for an ``update_parameter_in_bucket``
  payload (``payload["transport"]`` is ``"cpu_serialize"`` or ``"cuda_ipc"``). cuda_ipc tensors are
  views of the sender's staging buffer: load, ``torch.cuda.current_stream().synchronize()``, drop them
  before the RPC returns. (``receive_cpu_serialize`` / ``open_cuda_ipc`` are the two halves.)
* ``broadcast_parameter(group_name, bucket_meta, device=None)`` -> ``[(name, tensor)]`` - receive one
  bucket (call once per bucket, in the sender's order).
* ``destroy_collective_group(group_name)`` -> bool - no-op (False) when this process never joined.
* ``bucket_checksums(buffer, offsets, nbytes)`` / ``start_checksums(tensors)`` launch checksums without a
  host sync; ``finish_checksums`` reads them (one sync for a whole sync's worth).
* ``compute_checksums(named_tensors)`` -> ``{name: [nbytes, word_sum, weighted_sum]}`` and
  ``verify_checksums(expected, actual)`` - raises ``WeightVerificationError`` naming the first
  differing parameter (also in ``.parameter``). Checksums are exact integer sums of the raw bytes
  (bit-exact, device-agnostic). The receiver computes them on the received tensors (names as sent),
  accumulating across buckets. Raised across vLLM's ``collective_rpc`` (which forwards only an error's
  text) as ``errors.carried_in_text(exc)``; ``wait_all`` re-raises it typed, with ``.dp_rank``.
* ``check_device_capacity(bucket_bytes, device, largest=meta.largest())`` - the free-memory guard the receive
  functions apply (it names the largest tensor when that alone cannot fit).

The receiver never knows about vLLM models: it returns named tensors; the extension loads them.
"""

from __future__ import annotations

from rlix_plugins.transport._broadcast import (
    BACKENDS,
    GroupHost,
    broadcast_parameter,
    destroy_collective_group,
    group_names,
    setup_collective_group,
    wait_for_teardowns,
)
from rlix_plugins.transport._bucket import (
    ALIGN_BYTES,
    BucketMeta,
    BucketRecord,
    align_up,
    dtype_to_str,
    iter_buckets,
    pack_bucket,
    str_to_dtype,
    unpack_bucket,
)
from rlix_plugins.transport._cache import CacheSnapshot, VersionedBucketCache
from rlix_plugins.transport._checksum import (
    bucket_checksums,
    compute_checksums,
    finish_checksums,
    start_checksums,
    tensor_checksum,
    verify_checksums,
)
from rlix_plugins.transport._cpu_serialize import make_cpu_serialize_payload, receive_cpu_serialize
from rlix_plugins.transport._cuda_ipc import make_cuda_ipc_payload, open_cuda_ipc
from rlix_plugins.transport._host_pull import (
    SharedHostBuffer,
    device_view,
    make_host_pull_payload,
    map_host_buffer,
    open_host_pull,
)
from rlix_plugins.transport._memory import check_device_capacity, check_host_capacity, host_available_bytes
from rlix_plugins.transport._place import (
    Place,
    check_comm_plan,
    export_node_env,
    local_place,
    rendezvous_address,
)
from rlix_plugins.transport._plan import CommPlan, DeviceRef, TargetPlan, build_comm_plan
from rlix_plugins.transport._receiver import receive_bucket
from rlix_plugins.transport._registry import registered_transports, same_gpu_transport
from rlix_plugins.transport._same_gpu import BucketTransport, SameGpuTransport, SyncTransport
from rlix_plugins.transport._sender import (
    FinishingEndpoint,
    PendingCall,
    ReceiverEndpoint,
    SyncReport,
    report_places,
    sync_weights,
    wait_all,
)

__all__ = [
    "ALIGN_BYTES",
    "BACKENDS",
    "BucketMeta",
    "BucketRecord",
    "BucketTransport",
    "CacheSnapshot",
    "CommPlan",
    "DeviceRef",
    "FinishingEndpoint",
    "GroupHost",
    "PendingCall",
    "Place",
    "ReceiverEndpoint",
    "SameGpuTransport",
    "SharedHostBuffer",
    "SyncReport",
    "SyncTransport",
    "TargetPlan",
    "VersionedBucketCache",
    "align_up",
    "broadcast_parameter",
    "bucket_checksums",
    "build_comm_plan",
    "check_comm_plan",
    "check_device_capacity",
    "check_host_capacity",
    "compute_checksums",
    "destroy_collective_group",
    "device_view",
    "dtype_to_str",
    "export_node_env",
    "finish_checksums",
    "group_names",
    "host_available_bytes",
    "iter_buckets",
    "local_place",
    "make_cpu_serialize_payload",
    "make_cuda_ipc_payload",
    "make_host_pull_payload",
    "map_host_buffer",
    "open_cuda_ipc",
    "open_host_pull",
    "pack_bucket",
    "receive_bucket",
    "receive_cpu_serialize",
    "registered_transports",
    "rendezvous_address",
    "report_places",
    "same_gpu_transport",
    "setup_collective_group",
    "start_checksums",
    "str_to_dtype",
    "sync_weights",
    "tensor_checksum",
    "unpack_bucket",
    "verify_checksums",
    "wait_all",
    "wait_for_teardowns",
]
