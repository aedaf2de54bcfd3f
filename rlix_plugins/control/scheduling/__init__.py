"""The scheduler actor and its planner.

* :mod:`.scheduler`: the ``Scheduler`` actor's public coroutine API (register, request/release GPUs, progress,
  status); :mod:`.cycle`: its state and the cycle (snapshot → plan → execute resizes → commit → signal), the
  background loop and the coordinator health probes.
* :mod:`.planner`: ``plan_cycle(snapshot) -> CyclePlan``, pure; its phases use :mod:`.plan_state` (one cycle's
  working state) and :mod:`.gap_ratio` (rollout GPUs divided by remaining work); :mod:`.invariants` checks
  every plan before it runs.
* :mod:`.config` (``SchedulerConfig``, call-argument checks), :mod:`.rebalance` (when the poll runs a cycle
  unasked), :mod:`.status` (``rlix status`` JSON).

Everything but ``scheduler`` and ``cycle`` is pure Python (no Ray), unit-tested without a cluster and reused by the
capacity simulator. Nothing is imported here: ``import rlix_plugins.control.scheduling.planner`` loads no Ray.
"""
