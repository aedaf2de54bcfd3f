"""Shrink a wheel for an offline GPU machine's kit: drop folders it does not need there, and keep one GPU architecture's code.

transformer-engine-cu13's libtransformer_engine.so is 559 MB, nearly all of it cubins for a dozen architectures;
one part of the kit carries at most 64 MiB. The CUDA runtime picks the cubin (or PTX) of the device's own architecture
from each fat binary and never reads the others, so their payloads are zeroed in place (the layout, the offsets
and every header stay as they were) and the wheel is re-deflated: zeros compress to almost nothing. Kept: every
cubin of the kept architecture, and PTX of it or an older one (JIT fallback) only in a fat binary with no such cubin
(where there is one the runtime never JITs the PTX: TE 2.12's PTX would add ~65 MiB). ``--drop PREFIX`` leaves out
the members under PREFIX (pulp's bundled CBC solver binaries: 15 MiB that modelopt's import of pulp never runs). The
wheel keeps its name; RECORD is rewritten. A GPU-kit tool:

    python3 tools/gpu-offline/gpukit/wheel_trim.py IN.whl OUTDIR [--arch 90] [--drop pulp/solverdir/ ...]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import struct
import sys
import zipfile
from pathlib import Path

FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)
ENTRY_PTX = 1


def _section(data: bytes | bytearray, wanted: str) -> tuple[int, int] | None:
    """(offset, size) of the ELF64 section called ``wanted``, or None."""
    if data[:4] != b"\x7fELF":
        return None
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i: int) -> tuple[int, ...]:
        return struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)

    names = header(shstrndx)[4]
    for i in range(shnum):
        h = header(i)
        start = names + h[0]
        if bytes(data[start : data.index(0, start)]).decode() == wanted:
            return h[4], h[5]
    return None


def zero_other_archs(data: bytearray, arch: int) -> tuple[int, int]:
    """Zero, in place, the payloads of every fat-binary entry not for ``arch``; returns (entries kept, bytes zeroed)."""
    found = _section(data, ".nv_fatbin")
    if found is None:
        return 0, 0
    pos, end = found[0], found[0] + found[1]
    kept = zeroed = 0
    while True:
        pos = data.find(FATBIN_MAGIC, pos, end)
        if pos < 0:
            return kept, zeroed
        _magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", data, pos)
        entry, stop = pos + header_size, pos + header_size + fat_size
        entries = []  # (kind, arch, payload offset, payload size)
        while entry < stop:
            kind, _version, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            entry_arch = struct.unpack_from("<I", data, entry + 28)[0]
            entries.append((kind, entry_arch, entry + entry_header, payload))
            entry += entry_header + payload
        has_cubin = any(kind != ENTRY_PTX and entry_arch == arch for kind, entry_arch, _, _ in entries)
        for kind, entry_arch, body, payload in entries:
            ptx_fallback = kind == ENTRY_PTX and entry_arch <= arch and not has_cubin
            if ptx_fallback or (kind != ENTRY_PTX and entry_arch == arch):
                kept += 1
            else:
                data[body : body + payload] = bytes(payload)
                zeroed += payload
        pos = stop


def _record_line(name: str, blob: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(blob).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(blob)}"


def trim_wheel(src: Path, out_dir: Path, arch: int, drop: tuple[str, ...] = ()) -> Path:
    """Write ``out_dir/<same name>``: the wheel without the members under ``drop``, its shared objects trimmed to
    ``arch``, RECORD rewritten and the WHEEL tag set to the one its file name carries (the cu13 wheel's WHEEL says
    cp310-cp310 under a py3-none name)."""
    out = out_dir / src.name
    tag = "-".join(src.stem.split("-")[-3:])
    with (
        zipfile.ZipFile(src) as zin,
        zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout,
    ):
        names = zin.namelist()
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        lines = []
        for name in names:
            if name == record or name.startswith(drop):
                continue
            blob = zin.read(name)
            if name.endswith(".so") or ".so." in name:
                data = bytearray(blob)
                kept, zeroed = zero_other_archs(data, arch)
                if zeroed:
                    print(
                        f"{name}: kept {kept} sm_{arch}/PTX entries, zeroed {zeroed / 2**20:.0f} MiB",
                        flush=True,
                    )
                blob = bytes(data)
            elif name.endswith(".dist-info/WHEEL"):
                text = [ln for ln in blob.decode().splitlines() if ln.strip() and not ln.startswith("Tag:")]
                blob = ("\n".join([*text, f"Tag: {tag}"]) + "\n").encode()
            info = zin.getinfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(info, blob, compresslevel=9)
            lines.append(_record_line(name, blob))
        lines.append(f"{record},,")
        zout.writestr(record, "\n".join(lines) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--arch", type=int, default=90, help="the SM architecture to keep (90: H100/H200)")
    parser.add_argument("--drop", action="append", default=[], help="leave out the members under this prefix")
    args = parser.parse_args(argv)
    if args.out_dir.resolve() == args.wheel.parent.resolve():
        parser.error("OUT_DIR must differ from the wheel's folder (the trimmed wheel keeps its name)")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = trim_wheel(args.wheel, args.out_dir, args.arch, tuple(args.drop))
    print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
