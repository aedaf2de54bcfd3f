"""Patch 0001 of the NeMo RL series, generated from :mod:`rlix_plugins.nemo_rl.hookspec` (its one source).

The seam NeMo RL gets (``nemo_rl/algorithms/rlix_hooks.py``) is the hookspec module with NeMo RL's license header,
and with the import of :func:`rlix_plugins.pipeline.versions.version_after_step` replaced by that function's source
(NeMo RL never imports rlix-plugins). ``tests/nemo_rl/without_nemo/test_hookspec.py`` fails when the shipped
patch differs.

Regenerate after editing the hookspec (or the version rule)::

    python -m rlix_plugins._seam_patch            # rewrites the patch; `--check` only compares
"""

from __future__ import annotations

import hashlib
import inspect
import sys
from collections.abc import Sequence
from typing import Final

from rlix_plugins.nemo_rl import hookspec
from rlix_plugins.patching import DEFAULT_SERIES_ROOT
from rlix_plugins.pipeline import versions

__all__ = ["SEAM_PATCH", "seam_patch_text", "seam_source"]

SEAM_PATCH: Final = DEFAULT_SERIES_ROOT / "7ea279a" / "0001-rlix-hooks-seam.patch"
SEAM_PATH: Final = "nemo_rl/algorithms/rlix_hooks.py"
_IMPORT: Final = "from rlix_plugins.pipeline.versions import version_after_step\n"
_LICENSE: Final = """\
# Copyright (c) 2026, NVIDIA CORPORATION.  All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""
_HEADER: Final = """\
From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: rlix <rlix@example.com>
Date: Sat, 21 Nov 2026 21:54:59 +0000
Subject: [PATCH 1/4] rlix: GPU time-sharing hook seam
 (nemo_rl/algorithms/rlix_hooks.py)

Adds a pluggy hook specification for GPU time-sharing of async GRPO, a no-op
default and a loader. The loader returns None unless RLIX_CONTROL_PLANE=rlix
(unknown values raise); only then are pluggy and the implementations registered
under the 'nemo_rl.rlix_hooks' entry-point group imported. Implementations are
checked against the specification when they are registered.
---
"""
#: Width of ``git format-patch``'s diffstat line.
_STAT_WIDTH: Final = 71


def seam_source() -> str:
    """The text of NeMo RL's ``rlix_hooks.py``."""
    source = inspect.getsource(hookspec)
    if source.count(_IMPORT) != 1:
        raise RuntimeError(f"{hookspec.__file__} must import the version rule once, as {_IMPORT.strip()!r}")
    rule = inspect.getsource(versions.version_after_step)
    return _LICENSE + source.replace(_IMPORT, f"\n{rule}\n")


def seam_patch_text() -> str:
    """Patch 0001 as ``git format-patch`` writes it (the blob id is git's, so ``git apply`` can check it)."""
    source = seam_source()
    data = source.encode()
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()[:9]  # git's object id, not a security use
    lines = source.splitlines(keepends=True)
    n = len(lines)
    stat = f" {SEAM_PATH} | {n} "
    stat += "+" * min(n, _STAT_WIDTH - len(stat))
    return (
        _HEADER
        + f"{stat}\n 1 file changed, {n} insertions(+)\n create mode 100644 {SEAM_PATH}\n\n"
        + f"diff --git a/{SEAM_PATH} b/{SEAM_PATH}\nnew file mode 100644\nindex 000000000..{blob}\n"
        + f"--- /dev/null\n+++ b/{SEAM_PATH}\n@@ -0,0 +1,{n} @@\n"
        + "".join("+" + line for line in lines)
    )


def main(argv: Sequence[str] = ()) -> int:
    text = seam_patch_text()
    if list(argv) == ["--check"]:
        same = SEAM_PATCH.read_text(encoding="utf-8") == text
        print(f"{SEAM_PATCH}: {'up to date' if same else 'differs from the hookspec: regenerate it'}")
        return 0 if same else 1
    if argv:
        print("usage: python -m rlix_plugins._seam_patch [--check]", file=sys.stderr)
        return 2
    SEAM_PATCH.write_text(text, encoding="utf-8")
    print(f"wrote {SEAM_PATCH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
