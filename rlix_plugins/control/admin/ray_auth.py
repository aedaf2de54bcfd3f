"""Ray token authentication as rlix uses it: on, unless ``rlix up --insecure-no-auth`` says otherwise.

What Ray 2.60 does (``ray/_private/authentication``, ``ray/scripts/scripts.py``, ``ray/_private/worker.py``):

* ``RAY_AUTH_MODE`` (``token`` or ``disabled``) is the mode; the token comes from ``RAY_AUTH_TOKEN``, else the
  file named by ``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``.
* a new local ``ray.init()`` turns token mode on when the variable is unset and writes ``~/.ray/auth_token`` if
  no token exists; ``ray start --head`` turns it on only when a token already exists (it never writes one);
  ``ray get-auth-token --generate`` writes one.
* a process joining by an explicit ``host:port`` never turns token mode on by itself (only ``address="auto"``
  does, and only for a head it finds on the machine: ``"auto"`` under ``RAY_ADDRESS=host:port``, as NeMo RL's
  ``init_ray`` joins, does not), so it sends no token and the GCS answers every call UNAUTHENTICATED; ``ray.init``
  then retries and fails with "Failed to connect". Such clients need ``RAY_AUTH_MODE=token``. A token-mode client
  joins a cluster without authentication just as well.

Ray writes ``~/.ray/auth_token`` with the umask's mode (usually 0644, in a 0755 directory: any local user could
read it and run code on the cluster) and never checks it. What rlix does: ``rlix up`` creates a missing token file
itself, 0600 in a 0700 directory from the start (``RAY_AUTH_TOKEN_PATH``'s file, else ``~/.ray/auth_token``), and
starts its head with ``RAY_AUTH_MODE=token``; ``client.check_reachable`` asks the GCS first and, when it demands a
token, turns token mode on for this process (what Ray does for ``"auto"``), or fails in one line naming where the
token goes. Both refuse a token file that another user could read or replace (:func:`check_private`).
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path
from typing import Final

from rlix_plugins import envs
from rlix_plugins.errors import RlixConfigError

MODE_ENV: Final = envs.RAY_AUTH_MODE
TOKEN_ENV: Final = envs.RAY_AUTH_TOKEN
TOKEN_PATH_ENV: Final = envs.RAY_AUTH_TOKEN_PATH
DEFAULT_TOKEN_FILE: Final = "~/.ray/auth_token"
#: How a user gets the token of a cluster onto the machine of a client.
WHERE_TOKENS_GO: Final = (
    f"copy the head's token (`ray get-auth-token` on the head's machine) to {DEFAULT_TOKEN_FILE}, "
    f"or set {TOKEN_ENV} or {TOKEN_PATH_ENV}"
)


def token_source() -> str:
    """Where Ray reads this process's token from (the first of its three places that is set)."""
    if envs.ray_auth_token():
        return TOKEN_ENV
    path = envs.ray_auth_token_path()
    if path:
        return f"{TOKEN_PATH_ENV}={path}"
    return DEFAULT_TOKEN_FILE


def token_file() -> Path:
    """The file Ray reads this process's token from when ``RAY_AUTH_TOKEN`` is unset (Ray expands no ``~`` in
    ``RAY_AUTH_TOKEN_PATH``)."""
    return Path(envs.ray_auth_token_path() or os.path.expanduser(DEFAULT_TOKEN_FILE))


def _refuse(path: Path, why: str, fix: str) -> RlixConfigError:
    return RlixConfigError(f"the Ray auth token file {path} {why}, and whoever can read or replace it controls "
                           f"the cluster; {fix}")


def _check_dir(path: Path) -> None:
    """The token file's directory must be this user's (or root's) and closed to writes by group and others."""
    try:
        st = path.parent.stat()
    except OSError as exc:
        raise RlixConfigError(f"cannot check the directory of the Ray auth token file {path}: "
                              f"{exc.strerror}") from None
    if st.st_uid not in (os.getuid(), 0):
        raise _refuse(path, f"is in a directory of uid {st.st_uid}", "keep it in a directory of your own")
    if st.st_mode & 0o022:
        mode = stat.S_IMODE(st.st_mode)
        raise _refuse(path, f"is in a directory that group or others may write (mode {mode:04o})",
                      f"run `chmod 700 {path.parent}` or keep it in a private directory")


def check_private(path: Path) -> None:
    """Refuse, in one line, a token file that another user could read or replace: it must be this user's regular
    file with no access for group or others, in a directory that passes :func:`_check_dir`."""
    try:
        st = path.stat()
    except OSError as exc:
        raise RlixConfigError(f"cannot check the Ray auth token file {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, "is not a regular file", f"put the token in a file or fix {TOKEN_PATH_ENV}")
    if st.st_uid != os.getuid():
        raise _refuse(path, f"belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})",
                      "use a token file of your own")
    if st.st_mode & 0o077:
        raise _refuse(path, f"is open to group or others (mode {stat.S_IMODE(st.st_mode):04o})",
                      f"run `chmod 600 {path}`")
    _check_dir(path)


def ensure_private_token() -> None:
    """Make sure the token Ray will read exists and is private (what ``rlix up`` does before starting a head).

    A missing token file is created with a fresh token in Ray's format (``ray get-auth-token --generate``'s:
    256 random bits as hex), mode 0600 from its first byte, its directory 0700 when that is missing too; an
    existing one is used as it is if :func:`check_private` passes. Nothing to do when ``RAY_AUTH_TOKEN`` holds the
    token itself."""
    if envs.ray_auth_token():
        return
    path = token_file()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise RlixConfigError(f"cannot create the directory of the Ray auth token file {path}: {exc.strerror}; "
                              f"fix it or set {TOKEN_PATH_ENV}") from None
    if os.path.lexists(path):
        check_private(path)
        return
    _check_dir(path)  # a new token in a directory others can write could be replaced behind our back
    try:  # O_EXCL: never through a link nor over a file just made by someone else; 0600 whatever the umask
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise RlixConfigError(f"cannot create the Ray auth token file {path}: {exc.strerror}; "
                              f"fix it or set {TOKEN_PATH_ENV}") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


def local_token() -> str | None:
    """This process's token as Ray loads it (None: none anywhere). A ``RAY_AUTH_TOKEN_PATH`` naming a missing or
    empty file, or a token file others could read or replace (:func:`check_private`), is a one-line error."""
    if not envs.ray_auth_token() and os.path.lexists(token_file()):
        check_private(token_file())
    from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]  # compiled, no stub
    from ray.exceptions import AuthenticationError

    loader = AuthenticationTokenLoader.instance()
    loader.reset_cache()  # a token file may have been written since (`rlix up`, `ray get-auth-token --generate`)
    try:
        if not loader.has_token(ignore_auth_mode=True):
            return None
        return str(loader.get_raw_token(ignore_auth_mode=True))
    except AuthenticationError:
        raise RlixConfigError(
            f"{TOKEN_PATH_ENV}={envs.ray_auth_token_path()} names no readable, non-empty token file; "
            f"fix or unset {TOKEN_PATH_ENV}"
        ) from None


def token_for(address: str) -> str:
    """The token to join ``address``, whose GCS demands one; a one-line error when this process cannot send one."""
    mode = envs.ray_auth_mode()
    if mode is not None and mode.lower() != "token":
        raise RlixConfigError(
            f"the Ray cluster at {address} requires its auth token, but {MODE_ENV}={mode} is set here; "
            f"unset {MODE_ENV}"
        )
    token = local_token()
    if token is None:
        raise RlixConfigError(
            f"the Ray cluster at {address} requires its auth token and this machine has none: {WHERE_TOKENS_GO}"
        )
    return token


def refused(address: str) -> RlixConfigError:
    return RlixConfigError(
        f"the Ray cluster at {address} refused this process's auth token (from {token_source()}); "
        f"it belongs to another cluster: {WHERE_TOKENS_GO}"
    )


def enable_token_mode() -> None:
    """Send the token on every Ray call of this process and its children (as Ray itself does for ``"auto"``).

    Ray 2.60 has a helper for it; Ray 2.56 (NeMo RL's lock at the pinned commit) has not: there the helper's two
    steps run here (token mode in the environment, Ray's cached config read again)."""
    try:
        from ray._private.authentication.authentication_token_setup import _enable_token_auth
    except ImportError:
        from ray._raylet import Config  # type: ignore[attr-defined]

        os.environ[MODE_ENV] = "token"
        Config.initialize("")
        return
    _enable_token_auth()


def enable_if_token_exists() -> None:
    """Where the GCS cannot be asked (no grpcio): token mode when the mode is unset and a token exists, which
    joins a cluster with or without authentication alike."""
    if envs.ray_auth_mode() is None and local_token() is not None:
        enable_token_mode()
