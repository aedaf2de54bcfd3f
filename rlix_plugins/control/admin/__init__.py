"""``rlix up/down/status/timeline``: the local Ray head rlix starts, its auth token, the commands."""
