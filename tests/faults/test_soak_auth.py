"""``benchmarks/soak.py`` starts its Ray cluster with token authentication on, as the tests do: a private token file
of its own when the caller has none, removed after the soak (the soak itself: ``test_soak.py``)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._repo import load_script

_SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


class _RayInitReached(Exception):
    pass


@pytest.fixture
def own_environ() -> Iterator[None]:
    """``soak.main`` sets variables for its Ray cluster: they are this test's only."""
    from ray._raylet import Config  # type: ignore[attr-defined]

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    Config.initialize("")  # Ray's view of RAY_AUTH_MODE follows the environment again


@pytest.mark.usefixtures("own_environ")
def test_the_soak_starts_ray_with_a_private_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import ray
    from ray._raylet import AuthenticationMode, get_authentication_mode  # type: ignore[attr-defined]

    soak = load_script(_SOAK, "rlix_soak_auth")
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        os.environ.pop(name, None)
    os.environ["HOME"] = str(tmp_path)  # the user's ~/.ray is left alone
    seen: dict[str, Any] = {}

    def init(*args: object, **kwargs: object) -> None:
        path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", tmp_path / ".ray" / "auth_token"))
        # ray_mode: the mode as this process's Ray sees it (its config was read at import), which must agree with
        # the variable its GCS and workers inherit, or its own calls go out without the token
        seen.update(mode=os.environ.get("RAY_AUTH_MODE"), ray_mode=get_authentication_mode(), path=path,
                    file=stat.S_IMODE(path.stat().st_mode), dir=stat.S_IMODE(path.parent.stat().st_mode),
                    token=path.read_text())
        raise _RayInitReached

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)  # this session's own cluster keeps running
    with pytest.raises(_RayInitReached):
        soak.main(["--out", str(tmp_path / "soak.json")])
    assert seen["mode"] == "token" and seen["ray_mode"] == AuthenticationMode.TOKEN
    assert (seen["file"], seen["dir"]) == (0o600, 0o700) and len(seen["token"]) == 64
    assert not seen["path"].parent.exists() and not (tmp_path / ".ray").exists()  # removed; ~/.ray untouched
