"""Wheel closure for NeMo RL's GRPO path on the GPU machine (Python 3.12, no network there).

Downloads each missing package's wheel with ``pip download --no-deps`` and follows its ``Requires-Dist`` (markers
evaluated for CPython 3.12 on Linux x86-64), skipping what the GPU image, the vLLM carry kit and the Ray kit already
provide. Resolving the whole tree with pip's resolver instead backtracks for > 10 minutes over torch's CUDA wheels.

    python3 tools/gpu-offline/gpu_nemokit_closure.py OUT_DIR PRESENT_FILE PKG [PKG ...]
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

TAGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"] + [
    arg for n in ("2_28", "2_27", "2_26", "2_24", "2_17", "2_5") for arg in ("--platform", f"manylinux_{n}_x86_64")
] + ["--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64"]
ENV = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
       "platform_machine": "x86_64", "sys_platform": "linux", "implementation_name": "cpython", "extra": ""}


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_of(out: Path, name: str) -> Path | None:
    stem = canon(name).replace("-", "_")
    hits = [p for p in out.glob("*.whl") if canon(p.name.split("-")[0]).replace("-", "_") == stem]
    return hits[0] if hits else None


def main() -> int:
    out, present_file, roots = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    out.mkdir(parents=True, exist_ok=True)
    present = {canon(line.split("==")[0].strip()) for line in present_file.read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    queue, seen = [Requirement(r) for r in roots], set()
    while queue:
        req = queue.pop()
        name = canon(req.name)
        if name in seen or name in present:
            continue
        seen.add(name)
        whl = wheel_of(out, name)
        if whl is None:
            spec = str(req.specifier) if req.specifier else ""
            r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *TAGS, "-d", str(out),
                                f"{req.name}{spec}"], capture_output=True, text=True)
            whl = wheel_of(out, name)
            if r.returncode or whl is None:
                print(f"MISSING {req}: {r.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
                continue
        with zipfile.ZipFile(whl) as zf:
            meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            msg = Parser().parsestr(zf.read(meta).decode())
        for dep in msg.get_all("Requires-Dist") or []:
            d = Requirement(dep)
            if d.marker is None or d.marker.evaluate(ENV):
                queue.append(d)
        print(f"{whl.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
