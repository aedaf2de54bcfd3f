"""``rlix demo``'s report (pure, no Ray): the per-step expand breakdown and the memory after each sleep."""

from __future__ import annotations

from typing import Any

from rlix_plugins.demo.run import format_event, resize_lines, step_report


def _expand(t: float, ranks: list[int]) -> dict[str, Any]:
    return {"op": "expand", "time": t, "ranks": ranks, "seconds": 0.6, "wake_s": 0.1, "sync_s": 0.4,
            "activate_s": 0.1, "version": 1, "published": 1, "verified": True}


def _shrink(t: float, ranks: list[int], memory: dict[Any, int | None]) -> dict[str, Any]:
    return {"op": "shrink", "time": t, "ranks": ranks, "reason": "scheduler", "seconds": 0.3, "drain_s": 0.1,
            "sleep_s": 0.2, "level": 2, "memory_after": memory}


def test_step_report_breaks_expands_down_and_keeps_memory_after_each_sleep() -> None:
    """Per step: wake/sync/activate of every expand; per sleep: each slept rank's memory (None on CPU)."""
    events = [
        {"kind": "registered", "train": [0], "infer": [0, 1]},
        {"kind": "started", "resizes": [{"op": "prewarm", "time": 1.0, "ranks": [0, 1], "seconds": 1.0,
                                         "memory_after": {0: None, 1: None}}, _expand(2.0, [1])]},
        {"kind": "step", "step": 0, "version": 1, "reward": 0.5, "seconds": 3.0,
         "resizes": [_shrink(3.0, [0], {"0": 300 << 20}), _expand(4.0, [0])]},
        {"kind": "done", "summary": {}, "resizes": [_shrink(5.0, [0, 1], {0: None, 1: None})]},
    ]
    engine_memory = [[{"op": "sleep2", "time": 2.9, "seconds": 0.1, "free_before": 10 << 30, "free_after": 12 << 30},
                      {"op": "wake", "time": 3.5, "seconds": 0.1, "free_before": 12 << 30, "free_after": 10 << 30}],
                     []]
    start, step0, end = step_report(events, engine_memory)
    assert start["step"] == "start" and start["sleeps"][0]["op"] == "prewarm"
    assert start["expands"] == [{"ranks": [1], "wake_s": 0.1, "sync_s": 0.4, "activate_s": 0.1, "total_s": 0.6,
                                 "version": 1, "verified": True}]
    assert step0["step"] == 0 and step0["version"] == 1 and step0["reward"] == 0.5
    assert step0["sleeps"] == [{"op": "shrink", "ranks": [0], "sleep_s": 0.2, "memory_after": {0: 300 << 20},
                                "device": {0: {"device_free_after_bytes": 12 << 30, "device_freed_bytes": 2 << 30}}}]
    assert [e["ranks"] for e in step0["expands"]] == [[0]]
    # the engines logged no sleep during the final shrink (window 3.7..5.0 s): no device numbers, not step 0's stale ones
    assert end["step"] == "end" and end["sleeps"][0]["memory_after"] == {0: None, 1: None}
    assert "device" not in end["sleeps"][0]
    assert resize_lines([{"per_step": [start, step0, end]}]) == [
        "  expand (median of 2): wake 0.10 s + sync 0.40 s + activate 0.10 s = 0.60 s",
        "  memory in use on a rank after its sleep: max 0.29 GiB over 1 sleeps; device memory freed per sleep: "
        "median 2.00 GiB",
    ]
    assert resize_lines([{"per_step": [end]}]) == ["  memory in use on a rank after its sleep: n/a (not measurable here)"]


def test_shrink_line_prints_the_memory_after_the_sleep() -> None:
    ev = {"kind": "step", "pipeline": "p0", "step": 0, "version": 1, "reward": 0.5, "seconds": 3.0,
          "train_wait_s": 1.0, "group_versions": [0], "ranks_used": [1],
          "resizes": [_shrink(3.0, [0], {0: 3 << 29}), _shrink(4.0, [1], {1: None})]}
    lines = format_event(ev)
    assert "memory in use after the sleep dp0 1.50 GiB" in lines[1]
    assert lines[2].endswith("memory in use after the sleep n/a")
