"""``--out`` directories of ``rlix demo`` and ``rlix simulate``: checked before any work starts, with a one-line
error that names the fix (a file, an unwritable place, an earlier run's results)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from rlix_plugins.errors import RlixConfigError


def make_out_dir(out: str | os.PathLike[str], *, keep: Iterable[str] = (), force: bool = False) -> Path:
    """Create ``out`` (parents too) and prove it writable; return it.

    ``keep``: names an earlier run leaves in ``out``; when one is there and ``force`` is not set, refuse rather
    than overwrite it silently."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise RlixConfigError(f"--out {str(out)!r} is a file, not a directory; pass a directory, e.g. --out out/run2")
    earlier = sorted(name for name in keep if (path / name).exists())
    if earlier and not force:
        raise RlixConfigError(
            f"--out {str(out)!r} holds an earlier run ({', '.join(earlier)}); pass --force to overwrite it "
            "or choose another --out"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise RlixConfigError(
            f"--out {str(out)!r}: cannot create or write this directory ({exc.strerror or type(exc).__name__}); "
            "pass a writable directory"
        ) from None
    return path
