"""The AMX permission helper (``rlix_plugins.vllm.amx``) against the real kernel, in fresh interpreters.

The permission is per process, so each case runs in its own interpreter: nothing this pytest process (or
its torch/oneDNN) asked for can leak in. On a CPU with AMX the request must be granted and visible in
``ARCH_GET_XCOMP_PERM``; on one without, it must be reported as not supported (or refused, when forced
past the ``/proc/cpuinfo`` check) without raising.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from rlix_plugins.vllm import amx

_XTILEDATA = 1 << amx.XFEATURE_XTILEDATA
_X86_64_LINUX = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")

_PROBE = r"""
import json, sys
from rlix_plugins.vllm import amx
before = amx.permitted_xfeatures()
first = amx.request_amx_permission(*sys.argv[1:])
second = amx.request_amx_permission(*sys.argv[1:])
print("PROBE" + json.dumps({"before": before, "status": first, "again": second,
                            "recorded": amx.amx_permission_status(), "after": amx.permitted_xfeatures()}))
"""


def _probe(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=60)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("PROBE")]
    assert out.returncode == 0 and lines, f"probe failed (rc {out.returncode}):\n{out.stdout}\n{out.stderr}"
    return json.loads(lines[-1][len("PROBE"):])  # type: ignore[no-any-return]


@pytest.mark.skipif(not _X86_64_LINUX, reason="arch_prctl XCOMP is x86-64 Linux only")
def test_request_matches_the_cpu_and_the_kernel_mask() -> None:
    res = _probe()
    assert res["status"] == res["again"] == res["recorded"]
    assert isinstance(res["before"], int) and res["before"] & 0b11 == 0b11, res  # x87 + SSE always permitted
    assert not res["before"] & _XTILEDATA, res  # a fresh process has no AMX tile data: it must ask
    if amx.cpu_has_amx():
        assert res["status"] == "granted" and res["after"] & _XTILEDATA, res
    else:
        assert res["status"] == "not supported: no amx_tile flag in /proc/cpuinfo", res
        assert res["after"] == res["before"], res


@pytest.mark.skipif(not _X86_64_LINUX, reason="arch_prctl XCOMP is x86-64 Linux only")
def test_a_refused_request_is_reported_not_raised(tmp_path: Path) -> None:
    """Past a ``/proc/cpuinfo`` that claims AMX, the real syscall runs: the kernel refuses it on a CPU
    without AMX (EOPNOTSUPP), and the helper reports that instead of raising."""
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f amx_bf16 amx_tile amx_int8\n")
    assert amx.cpu_has_amx(str(fake))
    res = _probe(str(fake))
    if amx.cpu_has_amx():
        assert res["status"] == "granted", res
    else:
        assert res["status"].startswith("refused: E") and "not supported" in res["status"], res
        assert not res["after"] & _XTILEDATA, res


def test_other_platforms_are_not_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "cpuinfo"
    fake.write_text("flags\t\t: amx_tile\n")
    monkeypatch.setattr(amx, "_status", None)
    monkeypatch.setattr(amx.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(amx, "_arch_prctl", lambda *a: pytest.fail("arch_prctl called off x86-64"))
    assert amx.request_amx_permission(str(fake)).startswith("not supported: ")
    assert amx.permitted_xfeatures() is None
    assert not amx.cpu_has_amx(str(tmp_path / "missing"))
