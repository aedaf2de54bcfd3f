"""The NeMo RL tests (layout: README.md here)."""

#: Scenarios copied into a patched NeMo RL checkout and run there by NeMo RL's pytest (``drives_nemo/``), never here.
collect_ignore = ["inside_nemo"]


def pytest_collection_modifyitems(items: list) -> None:
    """``without_nemo/`` first: started after the ``drives_nemo/`` runs (their private Ray heads), the session's Ray
    cluster left three placement tests without an answer from their placement groups (120 s); started first, as
    before this layout, they pass. Stable otherwise."""
    here = [i for i, item in enumerate(items) if "/tests/nemo_rl/" in item.path.as_posix()]
    ordered = sorted((items[i] for i in here), key=lambda item: "/without_nemo/" not in item.path.as_posix())
    for i, item in zip(here, ordered, strict=True):  # only the NeMo RL tests move, among themselves
        items[i] = item
