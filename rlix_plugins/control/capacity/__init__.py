"""What a shared pool delivers, and the picture of who held which GPU when.

* :mod:`.simulation`: a time-stepped model of async-GRPO pipelines scheduled by the real planner
  (``JobSpec``, ``Placement``, ``Simulation`` → ``SimRun``); pure Python.
* :mod:`.comparison`: ``rlix simulate``: the same jobs under rlix, a static partition and one after another
  (``compare`` → ``Comparison``), and the command's options.
* :mod:`.timeline`: the Gantt chart of GPU occupancy from scheduler trace events (``rlix timeline``,
  ``rlix simulate``, ``rlix demo``); matplotlib is imported only when a picture is drawn.
"""
