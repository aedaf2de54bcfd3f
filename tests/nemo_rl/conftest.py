"""The NeMo RL tests (layout: README.md here)."""

#: Scenarios copied into a patched NeMo RL checkout and run there by NeMo RL's pytest (``drives_nemo/``), never here.
collect_ignore = ["inside_nemo"]
