"""tools/gpu-offline/gpukit/wheel_trim.py (the Megatron GPU kit's wheel shrinker) on a synthetic ELF fat binary and wheel."""

from __future__ import annotations

import base64
import hashlib
import struct
import zipfile
from email.parser import Parser
from pathlib import Path
from types import ModuleType

import pytest

from tests._repo import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "gpu-offline" / "gpukit" / "wheel_trim.py"
ELF, PTX = 2, 1
ENTRY_HEADER = 64


def _load() -> ModuleType:
    return load_script(SCRIPT, "wheel_trim")


def _fatbin(entries: list[tuple[int, int, bytes]]) -> bytes:
    body = b""
    for kind, arch, payload in entries:
        header = bytearray(ENTRY_HEADER)
        struct.pack_into("<HHIQ", header, 0, kind, 1, ENTRY_HEADER, len(payload))
        struct.pack_into("<I", header, 28, arch)
        body += bytes(header) + payload
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def _elf(fatbin_section: bytes) -> bytes:
    """A minimal ELF64: header, .shstrtab, .nv_fatbin, then the section headers."""
    names = b"\0.shstrtab\0.nv_fatbin\0"
    strtab_off = 64
    fatbin_off = strtab_off + len(names)
    shoff = fatbin_off + len(fatbin_section)
    header = bytearray(64)
    header[:4] = b"\x7fELF"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, 3, 1)
    sections = bytes(64)  # the null section
    sections += struct.pack("<IIQQQQIIQQ", 1, 3, 0, 0, strtab_off, len(names), 0, 0, 1, 0)
    sections += struct.pack("<IIQQQQIIQQ", 11, 1, 0, 0, fatbin_off, len(fatbin_section), 0, 0, 8, 0)
    return bytes(header) + names + fatbin_section + sections


def _payloads(elf: bytes) -> list[tuple[int, int, bytes]]:
    out, pos = [], elf.find(struct.pack("<I", 0xBA55ED50))
    while pos >= 0:
        _, _, header_size, size = struct.unpack_from("<IHHQ", elf, pos)
        entry, stop = pos + header_size, pos + header_size + size
        while entry < stop:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", elf, entry)
            arch = struct.unpack_from("<I", elf, entry + 28)[0]
            body = entry + entry_header
            out.append((kind, arch, elf[body : body + payload]))
            entry = body + payload
        pos = elf.find(struct.pack("<I", 0xBA55ED50), stop)
    return out


def test_zero_other_archs_keeps_sm90_and_older_ptx_only_where_no_sm90_cubin() -> None:
    trim = _load()
    first = [
        (ELF, 80, b"\xaa" * 40),
        (ELF, 90, b"\xbb" * 24),
        (PTX, 80, b"\xcc" * 16),
        (PTX, 90, b"\x33" * 6),
    ]
    second = [(PTX, 100, b"\xdd" * 32), (ELF, 120, b"\xee" * 8)]
    third = [(PTX, 80, b"\x11" * 12), (PTX, 90, b"\x44" * 2), (ELF, 100, b"\x22" * 4)]
    # 8 bytes of padding between the fat binaries, as the linker leaves them
    data = bytearray(_elf(_fatbin(first) + bytes(8) + _fatbin(second) + bytes(8) + _fatbin(third)))
    size = len(data)

    kept, zeroed = trim.zero_other_archs(data, 90)

    assert (kept, zeroed) == (3, 40 + 16 + 6 + 32 + 8 + 4)
    assert len(data) == size
    assert _payloads(bytes(data)) == [
        (ELF, 80, bytes(40)),
        (ELF, 90, b"\xbb" * 24),
        (PTX, 80, bytes(16)),  # the sm_90 cubin beside them is what the runtime loads
        (PTX, 90, bytes(6)),
        (PTX, 100, bytes(32)),
        (ELF, 120, bytes(8)),
        (PTX, 80, b"\x11" * 12),  # no sm_90 cubin here: the JIT fallbacks stay
        (PTX, 90, b"\x44" * 2),
        (ELF, 100, bytes(4)),
    ]


def test_trim_wheel_drops_prefix_rewrites_record_and_sets_the_tag(tmp_path: Path) -> None:
    trim = _load()
    src_dir = tmp_path / "in"
    src_dir.mkdir()
    wheel = src_dir / "demo_cu13-1.0-py3-none-manylinux_2_28_x86_64.whl"
    lib = _elf(_fatbin([(ELF, 80, b"\xaa" * 64), (ELF, 90, b"\xbb" * 8)]))
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("demo/lib.so", lib)
        z.writestr("demo/solverdir/cbc", b"binary")
        z.writestr("demo/__init__.py", b"")
        z.writestr(
            "demo_cu13-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nTag: cp310-cp310-manylinux_2_28_x86_64\n\n"
        )
        z.writestr("demo_cu13-1.0.dist-info/RECORD", "stale\n")

    out = trim.trim_wheel(wheel, tmp_path, 90, ("demo/solverdir/",))

    assert out == tmp_path / wheel.name
    with zipfile.ZipFile(out) as z:
        assert sorted(z.namelist()) == [
            "demo/__init__.py",
            "demo/lib.so",
            "demo_cu13-1.0.dist-info/RECORD",
            "demo_cu13-1.0.dist-info/WHEEL",
        ]
        assert _payloads(z.read("demo/lib.so")) == [(ELF, 80, bytes(64)), (ELF, 90, b"\xbb" * 8)]
        wheel_meta = Parser().parsestr(z.read("demo_cu13-1.0.dist-info/WHEEL").decode())
        assert wheel_meta.get_all("Tag") == ["py3-none-manylinux_2_28_x86_64"]
        record = z.read("demo_cu13-1.0.dist-info/RECORD").decode().splitlines()
        for line in record:
            name, digest, size = line.rsplit(",", 2)
            if name.endswith("RECORD"):
                assert (digest, size) == ("", "")
                continue
            blob = z.read(name)
            want = base64.urlsafe_b64encode(hashlib.sha256(blob).digest()).rstrip(b"=").decode()
            assert (digest, int(size)) == (f"sha256={want}", len(blob))
        assert len(record) == 4


def test_main_refuses_to_overwrite_its_input(tmp_path: Path) -> None:
    trim = _load()
    wheel = tmp_path / "x-1.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    with pytest.raises(SystemExit):
        trim.main([str(wheel), str(tmp_path)])
