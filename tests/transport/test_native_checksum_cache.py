"""The native checksum kernel's cache (``_native_checksum``) only ever has this process load private code: the
cache directory is created 0700; a directory that is not this user's or that others can write is not used (torch
path, one warning naming the fix); a cached library that is not this user's or that others can write is built
again, its code never run. And a fork while another thread builds the kernel gives a child that can checksum."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rlix_plugins.transport import _native_checksum
from rlix_plugins.transport._checksum import PackChecksums, finish_checksums, tensor_checksum

CC = os.environ.get("CC", "cc")
pytestmark = pytest.mark.skipif(not shutil.which(CC), reason="no C compiler: the torch path is the only one")
#: an unprivileged uid for files "of another user" (chown needs root)
OTHER_UID = 65534


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """The kernel switched on and built afresh with ``tmp_path/xdg`` as XDG_CACHE_HOME; yields its cache directory
    (not created yet). Later tests load the usual kernel again."""
    monkeypatch.delenv(_native_checksum.ENV_SWITCH, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    _native_checksum.reset()
    yield tmp_path / "xdg" / "rlix-plugins"
    _native_checksum.reset()


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _kernel_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """The file name the kernel's library has in the cache here (built once into another cache to learn it)."""
    xdg = os.environ["XDG_CACHE_HOME"]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "elsewhere"))
    assert _native_checksum.available()
    _native_checksum.reset()
    monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    (lib,) = (tmp_path / "elsewhere" / "rlix-plugins").glob("*.so")
    return lib.name


def _planted_library(tmp_path: Path) -> tuple[Path, Path]:
    """A library whose constructor (run by dlopen, before any symbol is looked up) creates a marker file; returns
    the library and the marker."""
    marker = tmp_path / "planted-code-ran"
    source = tmp_path / "planted.c"
    source.write_text('#include <stdio.h>\n__attribute__((constructor)) static void planted(void) {\n'
                      f'    FILE *f = fopen("{marker}", "w");\n    if (f) fclose(f);\n}}\n')
    lib = tmp_path / "planted.so"
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(lib), str(source)], check=True, timeout=60)
    return lib, marker


def _packs_right() -> bool:
    """A CPU pack's checksums (the kernel's, or torch's without it) are the definition's."""
    src = torch.randint(0, 256, (700,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    sums = PackChecksums(torch.full((1024,), 0xAB, dtype=torch.uint8))
    sums.copy(0, src)
    return finish_checksums([700], sums.finish()) == [tensor_checksum(src)]


@pytest.mark.usefixtures("umask_022")
def test_the_cache_directory_and_library_are_created_private(cache: Path) -> None:
    assert _native_checksum.available()
    assert _mode(cache) == 0o700
    (lib,) = cache.iterdir()
    assert lib.stat().st_uid == os.getuid() and not _mode(lib) & 0o077


@pytest.mark.parametrize(("mode", "owner"), [(0o664, None), (0o666, None), (0o755, OTHER_UID)],
                         ids=["group-writable", "world-writable", "another-users"])
def test_a_cached_library_others_could_write_is_built_again_never_loaded(
        mode: int, owner: int | None, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    if owner is not None and os.getuid() != 0:
        pytest.skip("giving a file to another user needs root")
    name = _kernel_name(monkeypatch, tmp_path)
    planted, marker = _planted_library(tmp_path)
    cache.mkdir(mode=0o700, parents=True)
    lib = cache / name
    shutil.copy(planted, lib)
    lib.chmod(mode)
    if owner is not None:
        os.chown(lib, owner, -1)
    with caplog.at_level(logging.WARNING, logger=_native_checksum.__name__):
        loaded = _native_checksum.available()
    assert not marker.exists(), "the planted library was loaded"
    assert loaded  # the kernel, built again in its place
    assert f"not loading {lib}" in caplog.text
    assert lib.read_bytes() != planted.read_bytes() and lib.stat().st_uid == os.getuid()
    assert not _mode(lib) & 0o077
    assert _packs_right()


@pytest.mark.parametrize(("mode", "owner"), [(0o777, None), (0o770, None), (0o700, OTHER_UID)],
                         ids=["world-writable", "group-writable", "another-users"])
def test_a_cache_directory_others_could_write_is_not_used(
        mode: int, owner: int | None, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Nothing in it is loaded, not even a library of this user's: the torch path, one warning naming the fix."""
    if owner is not None and os.getuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    name = _kernel_name(monkeypatch, tmp_path)
    planted, marker = _planted_library(tmp_path)
    cache.mkdir(parents=True)
    shutil.copy(planted, cache / name)
    (cache / name).chmod(0o700)
    cache.chmod(mode)
    if owner is not None:
        os.chown(cache, owner, -1)
    with caplog.at_level(logging.WARNING, logger=_native_checksum.__name__):
        assert not _native_checksum.available()
    assert not marker.exists(), "a library of a directory others can write was loaded"
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert f"run `chmod 700 {cache}`" in caplog.text
    assert _packs_right()


def test_a_fork_while_another_thread_builds_the_kernel_gives_a_child_that_can_checksum(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build lock is held across the compile; a child forked then has a copy of it held by a thread it does not
    have. Its first checksum must not wait for that lock forever: it builds the kernel itself or takes the torch
    path, within a deadline."""
    compiling = tmp_path / "compiling"
    slow_cc = tmp_path / "slow-cc"
    slow_cc.write_text(f'#!/bin/sh\n: > "{compiling}"\nsleep 2\nexec "{shutil.which(CC)}" "$@"\n')
    slow_cc.chmod(0o755)
    monkeypatch.setenv("CC", str(slow_cc))
    builder = threading.Thread(target=_native_checksum.available)
    builder.start()
    try:
        deadline = time.monotonic() + 30
        while not compiling.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert compiling.exists(), "the compiler never started"
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only on right checksums (a hang is caught by the parent's deadline)
            code = 1
            try:
                torch.set_num_threads(1)  # no OpenMP pool inherited mid-use
                code = 0 if _packs_right() else 1
            finally:
                os._exit(code)
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the child forked during the kernel's build hung on its first checksum")
        assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        builder.join(120)
    assert _native_checksum.available() and _packs_right()  # the parent's build finished meanwhile
