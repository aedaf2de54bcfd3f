"""Ray token authentication as rlix uses it: on, unless ``rlix up --insecure-no-auth`` says otherwise.

What Ray 2.60 does (``ray/_private/authentication``, ``ray/scripts/scripts.py``, ``ray/_private/worker.py``):

* ``RAY_AUTH_MODE`` (``token`` or ``disabled``) is the mode; the token comes from ``RAY_AUTH_TOKEN``, else the
  file named by ``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``.
* a new local ``ray.init()`` turns token mode on when the variable is unset and writes ``~/.ray/auth_token`` if
  no token exists; ``ray start --head`` turns it on only when a token already exists (it never writes one);
  ``ray get-auth-token --generate`` writes one.
* a process joining by an explicit ``host:port`` never turns token mode on by itself (only ``address="auto"``
  does), so it sends no token and the GCS answers every call UNAUTHENTICATED; ``ray.init`` then retries and fails
  with "Failed to connect". A token-mode client joins a cluster without authentication just as well.

What rlix does: ``rlix up`` makes sure a token exists and starts its head with ``RAY_AUTH_MODE=token``;
``client.check_reachable`` asks the GCS first and, when it demands a token, turns token mode on for this process
(what Ray does for ``"auto"``), or fails in one line naming where the token goes.
"""

from __future__ import annotations

import os
from typing import Final

from rlix_plugins.errors import RlixConfigError

MODE_ENV: Final = "RAY_AUTH_MODE"
TOKEN_ENV: Final = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV: Final = "RAY_AUTH_TOKEN_PATH"
DEFAULT_TOKEN_FILE: Final = "~/.ray/auth_token"
#: How a user gets the token of a cluster onto the machine of a client.
WHERE_TOKENS_GO: Final = (
    f"copy the head's token (`ray get-auth-token` on the head's machine) to {DEFAULT_TOKEN_FILE}, "
    f"or set {TOKEN_ENV} or {TOKEN_PATH_ENV}"
)


def token_source() -> str:
    """Where Ray reads this process's token from (the first of its three places that is set)."""
    if os.environ.get(TOKEN_ENV):
        return TOKEN_ENV
    if os.environ.get(TOKEN_PATH_ENV):
        return f"{TOKEN_PATH_ENV}={os.environ[TOKEN_PATH_ENV]}"
    return DEFAULT_TOKEN_FILE


def local_token() -> str | None:
    """This process's token as Ray loads it (None: none anywhere). A ``RAY_AUTH_TOKEN_PATH`` naming a missing or
    empty file is a one-line error."""
    from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]  # compiled, no stub
    from ray.exceptions import AuthenticationError

    loader = AuthenticationTokenLoader.instance()
    loader.reset_cache()  # `ray get-auth-token --generate` may have written one since
    try:
        if not loader.has_token(ignore_auth_mode=True):
            return None
        return str(loader.get_raw_token(ignore_auth_mode=True))
    except AuthenticationError:
        raise RlixConfigError(
            f"{TOKEN_PATH_ENV}={os.environ.get(TOKEN_PATH_ENV)} names no readable, non-empty token file; "
            f"fix or unset {TOKEN_PATH_ENV}"
        ) from None


def token_for(address: str) -> str:
    """The token to join ``address``, whose GCS demands one; a one-line error when this process cannot send one."""
    mode = os.environ.get(MODE_ENV)
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
    """Send the token on every Ray call of this process and its children (as Ray itself does for ``"auto"``)."""
    from ray._private.authentication.authentication_token_setup import _enable_token_auth

    _enable_token_auth()


def enable_if_token_exists() -> None:
    """Where the GCS cannot be asked (no grpcio): token mode when the mode is unset and a token exists, which
    joins a cluster with or without authentication alike."""
    if os.environ.get(MODE_ENV) is None and local_token() is not None:
        enable_token_mode()
