"""Memory telemetry without a GPU: RSS fallback with its reason, per-phase peaks, allocator view.

Run: `pytest tests/test_audit_memory.py`.
"""

from __future__ import annotations

import torch

from verlaudit.audit.memory import GB, MemoryMonitor


def test_rss_fallback_sees_a_phase_allocation():
    mon = MemoryMonitor("cpu", interval=0.005).start()
    try:
        with mon.phase("rollout"):
            pass
        with mon.phase("actor_update"):
            big = torch.ones(64 * 1024 * 1024, dtype=torch.float32)  # 256 MiB, touched by ones()
            mon.sample()
            del big
        m = mon.step_metrics()
    finally:
        mon.stop()
    assert mon.source == "rss" and "RSS" in mon.reason  # a reason, not an exception
    # the update phase held 0.25 GB more than the empty rollout phase did
    assert m["memory/actor_update/device_peak_gb"] - m["memory/rollout/device_peak_gb"] > 0.2
    assert m["perf/device_memory_peak_gb"] >= m["memory/actor_update/device_peak_gb"]
    assert "perf/max_memory_allocated_gb" not in m  # no CUDA allocator to ask
    assert (
        mon.step_metrics()["perf/device_memory_peak_gb"] < m["perf/device_memory_peak_gb"] + 1
    )  # reset per step
    view = mon.allocator_view()
    assert view["source"] == "rss" and view["rss_gb"] > 0 and "actor_update" in view["phase_peak_gb_so_far"]
    assert mon.summary()["phase_peak_gb"]["actor_update"] * GB > 0
