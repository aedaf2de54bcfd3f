"""Demo trajectory collector: an async-GRPO-shaped rollout loop that routes through the pipeline's router.

A Ray actor (like NeMo RL's AsyncTrajectoryCollector) with worker threads that keep generating groups (one
prompt x ``group_size`` samples) with the current weight version ``v``. A group targets the earliest training
step in ``[v, v + max_age]`` that is not yet full and not yet trained (NeMo RL's age window); when every
allowed target is full the workers pause. ``sample(step, n)`` hands the trainer ``n`` groups targeted at
``step``. Progress = groups intended for the current step (not the age-window count), reported raw to the
coordinator through the runtime's :class:`~rlix_plugins.pipeline.runtime.ProgressReporter`.

Routing goes through the runtime's :class:`~rlix_plugins.pipeline.router.RouterClient`
(``PipelineRuntime.router_client()``: state in the router actor, never a local copy that a resize would leave
stale); a request aborted by a shrink is retried on another active rank. Weight versions arrive through
:class:`~rlix_plugins.pipeline.publisher.CollectorPublisher` (``set_weight_version``), as for NeMo RL's collector.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from rlix_plugins.errors import PipelineUnregisteredError, RlixError, RlixTimeoutError

__all__ = ["DemoCollector"]


class DemoCollector:
    """See the module docstring."""

    def __init__(self, router: Any, engines: list[Any], reporter: Any, *, prompts_per_step: int, group_size: int,
                 max_tokens: int, max_age: int = 1, prompt_len: int = 8, vocab: int = 1000, seed: int = 0,
                 request_timeout_s: float = 120.0) -> None:
        self.router = router
        self.engines = list(engines)
        self.reporter = reporter
        self.prompts_per_step = prompts_per_step
        self.group_size = group_size
        self.max_tokens = max_tokens
        self.max_age = max_age
        self.prompt_len = prompt_len
        self.vocab = vocab
        self.request_timeout_s = request_timeout_s
        self._rng = random.Random(seed)
        self._cond = threading.Condition()
        self._version = 0  # NeMo RL's collector starts at 0 (hence: never publish -1, which deadlocks it)
        self._step = 0  # the next step the trainer samples
        self._buffer: dict[int, list[dict[str, Any]]] = {}
        self._pending: dict[int, int] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._versions_seen: list[int] = [0]
        self._errors: list[str] = []
        #: an engine actor died: no retry brings it back, so ``sample`` fails at once instead of timing out
        self._fatal: str | None = None
        self._generated = 0

    # ------------------------------------------------------------------ VersionPublisher target
    def set_weight_version(self, version: int) -> None:
        with self._cond:
            if version < 0:
                raise RlixError(f"weight version {version} < 0 published to the collector (it starts at 0)")
            if version != self._version:
                self._versions_seen.append(version)
            self._version = version
            self._cond.notify_all()

    # ------------------------------------------------------------------ lifecycle
    def start(self, workers: int) -> None:
        for i in range(workers):
            t = threading.Thread(target=self._work, name=f"collector-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ generation
    def _target(self) -> int | None:
        lo = max(self._version, self._step)
        for t in range(lo, self._version + self.max_age + 1):
            if len(self._buffer.get(t, ())) + self._pending.get(t, 0) < self.prompts_per_step:
                return t
        return None

    def _report(self, new_batch: bool = False) -> None:
        if self.reporter is not None:
            self.reporter.report(len(self._buffer.get(self._step, ())), self.prompts_per_step, self._step, new_batch)

    def _generator(self, prompt: list[int]) -> Callable[[int], dict[str, Any]]:
        def generate(rank: int) -> dict[str, Any]:
            ref = self.engines[rank].generate.remote(prompt, self.group_size, self.max_tokens, 1.0, None,
                                                     self.request_timeout_s)
            return dict(ray.get(ref, timeout=self.request_timeout_s + 30))

        return generate

    def _work(self) -> None:
        from rlix_plugins.pipeline.router import RouterClient

        client: RouterClient = self.router
        while not self._stop.is_set():
            with self._cond:
                target = self._target()
                if target is None:
                    self._cond.wait(0.2)
                    continue
                self._pending[target] = self._pending.get(target, 0) + 1
                version = self._version
                prompt = [self._rng.randrange(16, self.vocab) for _ in range(self.prompt_len)]
            try:
                result = client.route(self._generator(prompt), is_aborted=lambda r: bool(r["aborted"]))
            except RlixTimeoutError:
                result = None  # no active rank for a long time: try again (or stop)
            except ray.exceptions.RayActorError as exc:
                with self._cond:
                    self._fatal = f"a rollout engine actor died: {str(exc).splitlines()[0][:200]}"
                result = None
                time.sleep(0.5)
            except PipelineUnregisteredError as exc:  # the scheduler failed the pipeline (or died): no rank comes back
                with self._cond:
                    self._fatal = str(exc)
                result = None
                time.sleep(0.5)
            except Exception as exc:
                with self._cond:
                    self._errors.append(f"{type(exc).__name__}: {exc}")
                result = None
                time.sleep(0.5)
            with self._cond:
                self._pending[target] -= 1
                if result is not None and target >= self._step:
                    self._buffer.setdefault(target, []).append(
                        {"prompt": prompt, "completions": result["tokens"], "version": version,
                         "dp_rank": result["dp_rank"], "target": target})
                    self._generated += 1
                    if target == self._step:
                        self._report()
                self._cond.notify_all()

    # ------------------------------------------------------------------ trainer side
    def sample(self, step: int, timeout_s: float) -> list[dict[str, Any]]:
        """Block until ``prompts_per_step`` groups targeted at ``step`` exist; return them."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._step = step
            self._report(new_batch=True)
            while len(self._buffer.get(step, ())) < self.prompts_per_step:
                if self._fatal is not None:
                    raise RlixError(f"collector: step {step} cannot be sampled: {self._fatal}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RlixTimeoutError(
                        f"collector: only {len(self._buffer.get(step, ()))}/{self.prompts_per_step} groups for step "
                        f"{step} after {timeout_s:.0f} s (weight version {self._version}; errors: {self._errors[-3:]})"
                    )
                self._cond.wait(min(left, 1.0))
            groups = self._buffer.pop(step)[: self.prompts_per_step]
            for t in [t for t in self._buffer if t <= step]:
                del self._buffer[t]
            self._step = step + 1
            self._report(new_batch=True)
            self._cond.notify_all()
            return groups

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {"version": self._version, "versions_seen": list(self._versions_seen), "step": self._step,
                    "generated": self._generated, "errors": list(self._errors),
                    "buffered": {t: len(g) for t, g in self._buffer.items()}}
