"""What a receiver keeps between calls: the sync in progress (:class:`Sync`), the worker's state
(:class:`ReceiverState`) and host_pull's knowledge per bucket layout (:class:`Layouts`, the one owner of the plans
built from it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlix_plugins.transport import finish_checksums
from rlix_plugins.transport._checksum_kernel import KernelChecksums, kernel_checksums
from rlix_plugins.transport._copy_kernel import KernelCopies, kernel_copies
from rlix_plugins.vllm.loading import WeightLoader
from rlix_plugins.vllm.receive_checksums import PiecesChecksums
from rlix_plugins.vllm.replay import BucketReplay, DirectCopies

if TYPE_CHECKING:
    import torch

    from rlix_plugins.transport import BucketMeta

__all__ = ["LayoutKey", "Layouts", "ReceiverState", "Sync", "layout_key"]

#: what makes two buckets load the same way (:func:`layout_key`)
LayoutKey = tuple[Any, ...]


def layout_key(meta: BucketMeta) -> LayoutKey:
    """What makes two buckets load the same way: names, offsets and dtypes (shapes follow from the model)."""
    return (meta.names, meta.offsets, meta.dtypes)


@dataclass
class Sync:
    """What one worker received in one sync (``sync_id``) and has not finalized yet."""

    sync_id: str
    mode: str
    staged: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    #: launched, not yet read: (names, nbytes, (n, 3) int32 partial sums) - read once, at finalize
    pending_sums: list[tuple[list[str], list[int], torch.Tensor]] = field(default_factory=list)
    buckets: int = 0
    loaded_eagerly: bool = False
    #: host_pull straight into the parameters: the layouts used, and the event after their last host read
    direct: list[tuple[BucketMeta, DirectCopies]] = field(default_factory=list)
    reads_done: Any = None
    #: a direct pull's checksums of the landed bytes, launched per bucket as its copies land: (names, pieces, partial)
    landed_sums: list[tuple[tuple[str, ...], list[list[Any]], Any]] = field(default_factory=list)
    landed_done: Any = None
    #: layouts first recorded in this sync: (meta, key, replay) - checked for the direct form at finalize
    recorded: list[tuple[BucketMeta, LayoutKey, BucketReplay]] = field(default_factory=list)
    #: host_pull: per layout key, the address of the pages this sync read it from (a new direct layout's copy plan)
    sources: dict[LayoutKey, int] = field(default_factory=dict)

    def wait_reads(self) -> None:
        """Block until every host page read of this sync landed (the sender may then rebuild its cache)."""
        if self.reads_done is not None:
            self.reads_done.synchronize()

    def checksums(self) -> dict[str, list[int]]:
        """Read every launched checksum (one host sync for the whole sync)."""
        out: dict[str, list[int]] = {}
        for names, nbytes, partial in self.pending_sums:
            out.update(zip(names, finish_checksums(nbytes, partial), strict=True))
        return out


class Layouts:
    """host_pull's knowledge per bucket layout (:func:`layout_key`), and the plans built from it, with one owner.

    ``replays``: the loader's copies recorded at a layout's first load (:mod:`.replay`); ``no_replay``: layouts whose
    load did something else (the loader runs every sync); ``direct``: layouts whose recorded copies go straight from
    the host pages into the parameters; ``landed_plans`` / ``copy_plans``: per direct layout, its landed-bytes checksum
    plan and its SM copy plan (from the pages it was last read from). Every plan is keyed by the layout's key and
    leaves with its layout (:meth:`forget`, :meth:`promote`): a plan never outlives the layout it was built from."""

    def __init__(self) -> None:
        self.replays: dict[LayoutKey, BucketReplay] = {}
        self.no_replay: set[LayoutKey] = set()
        self.direct: dict[LayoutKey, DirectCopies] = {}
        self.landed_plans: dict[LayoutKey, PiecesChecksums | KernelChecksums] = {}
        self.copy_plans: dict[LayoutKey, KernelCopies] = {}

    def direct_for(self, keys: list[LayoutKey], params: set[int]) -> list[DirectCopies] | None:
        """The direct layouts of ``keys`` when every one is direct and its parameters did not move; else None."""
        found = [self.direct.get(k) for k in keys]
        if all(d is not None and d.valid(params) for d in found):
            return found  # type: ignore[return-value]
        return None

    def replay(self, key: LayoutKey, params: set[int]) -> BucketReplay | None:
        """The recorded copies of ``key``, None when there are none or its parameters moved (then forgotten, with
        everything built from them: the loader runs, and records again)."""
        replay = self.replays.get(key)
        if replay is not None and not replay.valid(params):
            self.forget(key)
            return None
        return replay

    def wants_recording(self, key: LayoutKey) -> bool:
        return key not in self.replays and key not in self.no_replay

    def recorded(self, key: LayoutKey, replay: BucketReplay | None) -> None:
        """The recording of ``key``'s first load: its copies, or None when the load did more than copy."""
        if replay is None:
            self.no_replay.add(key)
        else:
            self.replays[key] = replay

    def promote(self, key: LayoutKey, layout: DirectCopies) -> None:
        """``key`` goes straight into the parameters from now on (plans of an earlier form of it leave)."""
        self.direct[key] = layout
        self.landed_plans.pop(key, None)
        self.copy_plans.pop(key, None)

    def forget(self, key: LayoutKey) -> None:
        self.replays.pop(key, None)
        self.direct.pop(key, None)
        self.landed_plans.pop(key, None)
        self.copy_plans.pop(key, None)

    def landed_plan(self, key: LayoutKey) -> PiecesChecksums | KernelChecksums:
        """The landed-bytes checksum plan of direct layout ``key``, built once: one kernel launch when the kernel
        passed its self-check (:mod:`rlix_plugins.transport._checksum_kernel`), else ~40 torch ops per 256 MiB."""
        plan = self.landed_plans.get(key)
        if plan is None:
            pieces = self.direct[key].pieces
            plan = self.landed_plans[key] = kernel_checksums(pieces) or PiecesChecksums(pieces)
        return plan

    def copy_plan(self, key: LayoutKey, source: int, device: Any) -> KernelCopies | None:
        """The SM copy plan of direct layout ``key`` from the pages at ``source`` (built when the layout became
        direct, again if the pages moved); None where the copy kernel is unavailable
        (:mod:`rlix_plugins.transport._copy_kernel`)."""
        plan = self.copy_plans.get(key)
        if plan is None or plan.source != source:
            copies = self.direct[key].copies
            built = kernel_copies(source, [(dst.data_ptr(), lo, hi) for dst, lo, hi in copies], device)
            if built is None:
                return None
            plan = self.copy_plans[key] = built
        return plan

    def info(self) -> dict[str, Any]:
        return {"direct_layouts": len(self.direct),
                #: direct layouts whose checksum plan is built (all, after the sync that made them direct), by kind
                "landed_plans": sorted(type(p).__name__ for p in self.landed_plans.values()),
                "copy_plans": len(self.copy_plans)}


@dataclass
class ReceiverState:
    """One worker's receiver state (vLLM never runs an extension's ``__init__``: created at the first call)."""

    loader: WeightLoader
    sync: Sync | None = None
    #: checksums of every parameter this worker finalized, latest value per name
    model_checksums: dict[str, list[int]] = field(default_factory=dict)
    finalized: list[str] = field(default_factory=list)
    #: an eager sync failed half-way: the model holds a mix of weights until the next finalize
    dirty: bool = False
    buckets_total: int = 0
    #: side stream for host_pull's host->device copies (created on the first pull)
    copy_stream: Any = None
    #: side stream for the checksums of a direct pull (they follow each bucket's copies)
    check_stream: Any = None
    #: where the last sync's time went on this worker (seconds per phase; ``rlix_receiver_info``)
    timing: dict[str, Any] = field(default_factory=dict)
    pulls: int = 0
    finishes: int = 0
    layouts: Layouts = field(default_factory=Layouts)
    #: checksums of parameter bytes as the last finalize left them, with the address of the one piece holding them
    #: (None: several pieces); one use: that sync's ``verify_model``
    landed: dict[str, tuple[list[int], int | None]] = field(default_factory=dict)
