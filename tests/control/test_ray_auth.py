"""The Ray auth token file as rlix creates and uses it: private from its first byte (0600 in a 0700 directory, under
any umask), in the place Ray reads it from (``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``), in Ray's format;
and a token file that another user could read or replace is refused in one line naming the fix."""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlix_plugins.control.admin import local_cluster, ray_auth
from rlix_plugins.errors import RlixConfigError


class _RayStartReached(Exception):
    """``start_head`` got as far as ``ray start --head``: its token step is done."""


@pytest.fixture(autouse=True)
def _forget_loaded_tokens() -> Iterator[None]:
    """Ray's token loader caches the token it read; this session's cluster must get its own token back (this
    fixture's teardown runs after the environment is restored)."""
    yield
    from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]

    AuthenticationTokenLoader.instance().reset_cache()


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The usual umask, under which Ray's own generator writes a token every local user can read."""
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh HOME (0755, like a usual one) and no token from the environment."""
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o755)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv(ray_auth.TOKEN_ENV, raising=False)
    monkeypatch.delenv(ray_auth.TOKEN_PATH_ENV, raising=False)
    return home


def _start_head_until_ray_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Run ``local_cluster.start_head`` (what ``rlix up`` calls) up to ``ray start --head``, which is stopped by
    raising ``_RayStartReached``: its token step only."""
    def popen(cmd: list[str], *args: object, **kwargs: object) -> object:
        if cmd[1:2] == ["start"]:
            raise _RayStartReached
        return subprocess.Popen(cmd, *args, **kwargs)  # type: ignore[call-overload]

    # local_cluster's own `subprocess` only: Ray subclasses the real Popen when imported
    monkeypatch.setattr(local_cluster, "subprocess", SimpleNamespace(**{**vars(subprocess), "Popen": popen}))
    monkeypatch.setattr(local_cluster.tempfile, "tempdir", str(tmp_path))  # its `ray start` temp dir
    local_cluster.start_head(num_gpus=1, num_cpus=1)


def _token_step_of_rlix_up(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(_RayStartReached):
        _start_head_until_ray_start(monkeypatch, tmp_path)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _ray_loads(path: Path) -> str:
    """The token Ray's own loader reads for this process (``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``)."""
    from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]

    loader = AuthenticationTokenLoader.instance()
    loader.reset_cache()
    assert loader.has_token(ignore_auth_mode=True), path
    return str(loader.get_raw_token(ignore_auth_mode=True))


@pytest.mark.usefixtures("umask_022")
@pytest.mark.parametrize("where", ["home", "token_path"])
def test_rlix_up_creates_a_private_token_that_ray_accepts(where: str, home: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`rlix up` on a machine without a token: the file is 0600 in a 0700 directory (not Ray's 0644 in 0755), in
    the place Ray reads it from, and Ray's own loader reads the token back (hex, as Ray generates it)."""
    if where == "home":
        path = home / ".ray" / "auth_token"
    else:
        path = tmp_path / "tokens" / "auth_token"
        monkeypatch.setenv(ray_auth.TOKEN_PATH_ENV, str(path))
    _token_step_of_rlix_up(monkeypatch, tmp_path)
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    token = path.read_text()
    assert len(token) == 64 and set(token) <= set("0123456789abcdef")  # Ray's format: 256 random bits as hex
    assert _ray_loads(path) == token == ray_auth.local_token()
    if where == "token_path":  # the file RAY_AUTH_TOKEN_PATH names, nothing in ~/.ray
        assert not (home / ".ray").exists()


@pytest.mark.usefixtures("umask_022")
def test_an_existing_private_token_is_used_as_it_is(home: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (home / ".ray").mkdir(mode=0o755)  # a directory Ray made before: readable, not writable, by others
    path = home / ".ray" / "auth_token"
    path.write_text("f" * 64)
    path.chmod(0o600)
    _token_step_of_rlix_up(monkeypatch, tmp_path)
    assert path.read_text() == "f" * 64 and _mode(path) == 0o600
    assert ray_auth.local_token() == "f" * 64


#: (file mode, directory mode, the fix the one-line error names: {path} / {dir} filled in)
_UNSAFE = [
    (0o644, 0o700, "run `chmod 600 {path}`"),  # Ray's own mode: every local user reads it
    (0o640, 0o700, "run `chmod 600 {path}`"),
    (0o620, 0o700, "run `chmod 600 {path}`"),  # group-writable: someone else's token could be put in
    (0o600, 0o770, "run `chmod 700 {dir}`"),  # the file could be replaced by another one
    (0o600, 0o757, "run `chmod 700 {dir}`"),
]


@pytest.mark.parametrize(("file_mode", "dir_mode", "fix"), _UNSAFE, ids=[f"{f:o}-in-{d:o}" for f, d, _ in _UNSAFE])
def test_a_token_file_others_could_read_or_replace_is_refused(file_mode: int, dir_mode: int, fix: str,
                                                              home: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """By `rlix up` before it starts anything, and by the client's join path (``local_token``), in one line."""
    directory = tmp_path / "tokens"
    directory.mkdir()
    path = directory / "auth_token"
    path.write_text("a" * 64)
    path.chmod(file_mode)
    directory.chmod(dir_mode)
    monkeypatch.setenv(ray_auth.TOKEN_PATH_ENV, str(path))
    want = fix.format(path=path, dir=directory)
    with pytest.raises(RlixConfigError) as refused:
        ray_auth.local_token()
    assert want in str(refused.value) and len(str(refused.value).splitlines()) == 1
    with pytest.raises(RlixConfigError, match="controls the cluster") as refused:  # before `ray start`
        _start_head_until_ray_start(monkeypatch, tmp_path)
    assert want in str(refused.value)
    assert path.read_text() == "a" * 64 and _mode(path) == file_mode  # nothing changed behind the user's back


def test_a_token_in_the_environment_needs_no_file(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ray_auth.TOKEN_ENV, "b" * 64)
    ray_auth.ensure_private_token()
    assert not (home / ".ray").exists()
    assert ray_auth.local_token() == "b" * 64
