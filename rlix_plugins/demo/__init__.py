"""Built-in demo host: tiny Qwen2 pipelines time-sharing GPUs through the shared pipeline runtime.

``rlix demo`` → :func:`rlix_plugins.demo.run.run_demo`. Pieces: :mod:`.engine` (vLLM DP-rank actors and the
fleet), :mod:`.trainer` (policy-gradient step + CPU bucket cache owner), :mod:`.collector` (async-GRPO-shaped
rollout through the router), :mod:`.pipeline` (the driver loop, in the patched NeMo RL hook order).
Importing this package imports neither vLLM nor torch.
"""
