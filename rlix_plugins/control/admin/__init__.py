"""``rlix up/down/status/timeline``: the library behind the commands (``rlix_plugins/cli.py`` only parses).

* :mod:`.commands`: ``up``, ``down``, ``status`` (and ``format_status``), ``timeline``; each returns an exit code
  and raises an ``RlixError`` for bad input or an unreachable cluster.
* :mod:`.local_cluster`: the Ray head ``rlix up`` started (own Unix session, private temp dir), recorded so later
  commands act on it and nothing else; ``rlix down --stop-ray`` ends exactly its processes.
* :mod:`.ray_auth`: Ray token authentication as rlix uses it (on unless ``--insecure-no-auth``); also used by
  the client to join a cluster by address.
"""
