"""The CPU pack path's copy-and-checksum in one pass over the bytes: a small C kernel (``_pack_checksum.c``).

:class:`~rlix_plugins.transport._checksum.PackChecksums` copies each CPU tensor into its bucket and takes the
checksum sums of the copied bytes. In torch that is a copy plus two reductions; the kernel reads each source
word once, stores it and adds it to its row and column sums in the same loop, so the build runs near memcpy
speed. It is compiled at first use with the system C compiler (``$CC``, default ``cc``) into a per-user cache
(``$XDG_CACHE_HOME/rlix-plugins`` or ``~/.cache/rlix-plugins``), loaded with ctypes and checked once per process
against the torch definition. Where any of that fails, or ``RLIX_NATIVE_CHECKSUM=0``, :func:`available` is
false and callers keep the torch path (one log line says why).

Loading a library runs its code, so only a private one is loaded: the cache directory is created 0700 and refused
(torch path) unless it is this user's and closed to writes by group and others; a cached library that is not this
user's regular file, or that group or others may write, is built again in its place.

A large tensor is split into row-aligned chunks (up to ``torch.get_num_threads()``, none under
:data:`MIN_CHUNK_BYTES`) that the calling thread and a pool of threads inside the C library copy in parallel, each
chunk knowing its first row so the row-weighted term stays the tensor's; ctypes drops the GIL for the call. The
pool is in C because a Python thread pool costs a GIL hand-off and a wake-up per chunk, which on a 16-core host
took as long as the copy.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Final

import torch

from rlix_plugins import envs

log = logging.getLogger(__name__)

#: set to ``0`` to keep the torch path (read on every use, so it can be flipped at run time)
ENV_SWITCH: Final = envs.RLIX_NATIVE_CHECKSUM
SOURCE: Final = Path(__file__).with_name("_pack_checksum.c")
#: the kernel's row: ``ROW_BYTES`` of ``_checksum`` (not imported: ``_checksum`` imports this module)
ROW_BYTES: Final = 512
#: ``[word_sum, row_weighted, 128 column sums]`` per call
OUT_WORDS: Final = 2 + ROW_BYTES // 4
#: smallest chunk per thread: a pool thread's wake-up (tens of microseconds) must stay small against its chunk
#: (an 8 MiB copy on a 16-core host ran at 94 GB/s in 1 MiB chunks, 56 GB/s in 2 MiB chunks)
MIN_CHUNK_BYTES: Final = 1 << 20
COMPILE_TIMEOUT_S: Final = 60
#: compiler flags, tried in order (a compiler or CPU that rejects -march=native gets the portable build)
_FLAG_SETS: Final = (
    ("-O3", "-march=native", "-fPIC", "-shared", "-pthread"),
    ("-O3", "-fPIC", "-shared", "-pthread"),
)

#: ``rlix_copy_sums_parallel(src, dst, nbytes, padded_bytes, chunks, out)``, addresses as ints
Kernel = Callable[[int, int, int, int, int, int], None]

_lock = threading.Lock()  # held across the build: compile, load and self-check
_fn: Kernel | None = None
_tried = False  # the kernel was loaded (``_fn``) or failed to load; either way not tried again
_said_off = False


def _after_fork_in_child() -> None:
    """A fork while another thread builds the kernel copies ``_lock`` held by a thread the child does not have:
    its first use would wait forever. The child gets a free lock; a finished build (``_tried``) is inherited
    whole, an unfinished one is started again in the child."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def available() -> bool:
    """Whether :func:`copy_sums` may be used: not switched off, and the kernel compiled, loaded and self-checked
    (the first call does that, once per process)."""
    global _said_off
    if not envs.native_checksum():
        if not _said_off:
            _said_off = True
            log.info("native pack checksum kernel switched off (%s=0): using the torch path", ENV_SWITCH)
        return False
    return (_fn if _tried else _load()) is not None


def reset() -> None:
    """Forget the loaded kernel so the next :func:`available` builds and checks it again (tests)."""
    global _fn, _tried
    with _lock:
        _fn, _tried = None, False


def copy_sums(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Copy the uint8 CPU bytes ``src`` to ``dst[:n]``, zero ``dst[n:padded]`` (``padded``: ``n`` rounded up to
    a whole row) and return ``[word_sum, sum_k (k + 1) * rowsum_k, 128 column sums]`` of the padded words as
    int32 (wrapped). Both contiguous uint8 CPU tensors; call only when :func:`available`."""
    fn = _fn
    if fn is None:
        raise RuntimeError("the native checksum kernel is not loaded; check available() first")
    n = src.numel()
    padded = -(-n // ROW_BYTES) * ROW_BYTES
    if not (src.dtype == dst.dtype == torch.uint8 and src.is_contiguous() and dst.is_contiguous()
            and src.device.type == dst.device.type == "cpu"):
        raise ValueError("copy_sums takes contiguous uint8 CPU tensors")
    if dst.numel() < padded:
        raise ValueError(f"destination of {dst.numel()} bytes cannot hold {n} bytes padded to {padded}")
    out = torch.empty(OUT_WORDS, dtype=torch.int32)
    fn(src.data_ptr(), dst.data_ptr(), n, padded, _chunks(padded), out.data_ptr())
    return out


def _chunks(padded: int) -> int:
    """How many threads copy ``padded`` bytes: one per :data:`MIN_CHUNK_BYTES` at most, up to torch's threads."""
    return max(1, min(torch.get_num_threads(), padded // MIN_CHUNK_BYTES))


def _load() -> Kernel | None:
    global _fn, _tried
    with _lock:
        if not _tried:
            try:
                fn = _build_and_open()
                problem = _self_check(fn)
            except Exception as exc:  # a missing compiler, a read-only cache, a broken toolchain: all mean torch
                fn, problem = None, f"{type(exc).__name__}: {exc}"
            if problem:
                log.warning("native pack checksum kernel unavailable, using the torch path: %s", problem)
                fn = None
            _fn, _tried = fn, True
        return _fn


def _cache_dir() -> Path:
    base = envs.xdg_cache_home() or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rlix-plugins"


def _private_cache_dir() -> Path:
    """The cache directory, created 0700; an error (so the torch path) unless it is this user's and group and
    others cannot write it: whoever can put a file in it could have this process load their code."""
    cache = _cache_dir()
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = cache.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise RuntimeError(f"the kernel cache {cache} (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})"
                           f" must be this user's and not writable by group or others; run `chmod 700 {cache}` as"
                           " its owner or set XDG_CACHE_HOME")
    return cache


def _private_file(path: Path) -> bool:
    """``path`` is a regular file (not a link) of this user's that group and others cannot write."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def _cpu_tag() -> str:
    """The CPU's instruction-set flags: a ``-march=native`` build must not be loaded on another kind of CPU that
    shares the home directory (it could die of an illegal instruction)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _build_and_open() -> Kernel:
    source = SOURCE.read_text(encoding="utf-8")
    cc = envs.c_compiler()
    cache = _private_cache_dir()
    errors = []
    for flags in _FLAG_SETS:
        key = "\0".join([source, cc, *flags, platform.machine(), _cpu_tag()])
        lib = cache / f"pack_checksum-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
        if not _private_file(lib):
            if os.path.lexists(lib):
                log.warning("not loading %s (not this user's file, or writable by group or others): building it "
                            "again", lib)
            fd, tmp = tempfile.mkstemp(prefix=lib.name, suffix=".tmp", dir=cache)  # 0600
            os.close(fd)
            try:
                proc = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True,
                                      timeout=COMPILE_TIMEOUT_S, check=False)
                if proc.returncode != 0:
                    errors.append(f"{cc} {' '.join(flags)}: {proc.stderr.strip()[-500:]}")
                    continue
                os.chmod(tmp, 0o700)  # this user's only: the linker widened it to 0777 & ~umask
                os.replace(tmp, lib)  # atomic: a racing process loads either its own build or this one
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        if not _private_file(lib):  # checked right before loading (the directory is private: nobody swaps it)
            raise RuntimeError(f"{lib} is not this user's private file after the build; not loading it")
        fn = ctypes.CDLL(str(lib)).rlix_copy_sums_parallel
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint,
                       ctypes.c_void_p]
        fn.restype = None
        return fn
    raise RuntimeError("; ".join(errors))


def _self_check(fn: Kernel) -> str:
    """Compare the kernel with the torch definition on random bytes of odd sizes at odd addresses, over stale
    destination bytes (and one copy large and aligned enough for the streaming stores, in chunks run by the
    thread pool); '' when they agree."""
    from rlix_plugins.transport._checksum import ROW_WORDS, finish_checksums, start_checksums

    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, ((2 << 20) + 1024,), dtype=torch.uint8, generator=g)
    weights = torch.arange(1, ROW_WORDS + 1, dtype=torch.int32)
    for n, dst_at, chunks in ((1, 1, 1), (511, 1, 1), (512, 1, 1), (1027, 3, 2), (3 * 4096 + 1, 1, 1),
                              ((2 << 20) + 515, 0, 2)):  # two chunks of 1 MiB and more: streamed
        src = data[1 : n + 1]  # odd address: the kernel's loads must not assume alignment
        padded = -(-n // ROW_BYTES) * ROW_BYTES
        dst = torch.full((padded + dst_at,), 0xAB, dtype=torch.uint8)[dst_at:]
        out = torch.empty(OUT_WORDS, dtype=torch.int32)
        fn(src.data_ptr(), dst.data_ptr(), n, padded, chunks, out.data_ptr())
        col_weighted = (out[2:] * weights).sum(dtype=torch.int32).view(1)
        got = finish_checksums([n], torch.cat([out[:2], col_weighted]).view(1, 3))
        want = finish_checksums([n], start_checksums([src]))
        if got != want:
            return f"checksums of {n} bytes differ from the torch definition: {got} != {want}"
        if not (torch.equal(dst[:n], src) and not dst[n:].any()):
            return f"the copy of {n} bytes or its zero padding is wrong"
    return ""
