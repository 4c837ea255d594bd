"""Memory telemetry without a GPU: RSS fallback with its reason, per-phase peaks, allocator view.

Run: `pytest tests/test_audit_memory.py`.
"""

from __future__ import annotations

import torch

from verlaudit.audit import memory
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
    view = mon.allocator_view()
    assert view["source"] == "rss" and view["rss_gb"] > 0 and "actor_update" in view["phase_peak_gb_so_far"]
    assert mon.summary()["phase_peak_gb"]["actor_update"] * GB > 0


def test_step_peaks_reset_per_step_and_the_run_peaks_do_not(monkeypatch):
    # the host's memory as a number we set: 10 GiB during the first step's update, 1 GiB after it
    rss = [1 * GB]
    monkeypatch.setattr(memory, "_rss_bytes", lambda: rss[0])
    mon = MemoryMonitor("cpu")  # not started: it samples only when asked (phase edges, step_metrics)
    with mon.phase("actor_update"):
        rss[0] = 10 * GB  # sampled when the phase ends
    rss[0] = 1 * GB
    first = mon.step_metrics()
    assert first["perf/device_memory_peak_gb"] == 10 and first["memory/actor_update/device_peak_gb"] == 10
    with mon.phase("rollout"):
        pass
    second = mon.step_metrics()
    # the second step saw 1 GiB and no update phase; without the reset it would repeat step one's 10
    assert second["perf/device_memory_peak_gb"] == 1 and second["memory/rollout/device_peak_gb"] == 1
    assert "memory/actor_update/device_peak_gb" not in second
    # the manifest's summary keeps the whole run's peaks
    assert mon.summary()["peak_gb"] == 10
    assert mon.summary()["phase_peak_gb"] == {"actor_update": 10, "rollout": 1}
