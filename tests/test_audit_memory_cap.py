"""The worker's emulated memory cap (`verlaudit.run.worker.apply_memory_cap`) on CPU, CUDA faked by monkeypatch.

Run: `pytest tests/test_audit_memory_cap.py` (no GPU needed; torch.cuda calls are replaced).
"""

from __future__ import annotations

import types

import pytest
import torch

from verlaudit.run.worker import apply_memory_cap

GiB = 1024**3


@pytest.fixture
def fake_cuda(monkeypatch):
    """A pretend 80 GiB GPU at index 1 (the current device); records what the cap was set to."""
    calls = []

    def props(device):
        # the real call accepts an index-less device, so the fake must not be more lenient
        # than set_per_process_memory_fraction, which is the one that needs the index
        return types.SimpleNamespace(total_memory=80 * GiB)

    def set_fraction(fraction, device):
        device = torch.device(device)
        if device.index is None:  # what torch raises for a bare "cuda"
            raise ValueError("Expected a torch.device with a specified index or an integer")
        calls.append((fraction, device))

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    return calls


def test_bare_cuda_device_caps_the_current_device(fake_cuda):
    out = apply_memory_cap({"target": "a100-40g", "memory_cap_gb": 20.0}, torch.device("cuda"))
    # 20 GB of an 80 GiB device: fraction 20 / 80 = 0.25, on the current device (index 1)
    assert fake_cuda == [(0.25, torch.device("cuda", 1))]
    assert out["applied"] is True and out["fraction"] == 0.25
    assert out["device"] == "cuda:1" and "cuda:1" in out["cap_reason"]


def test_indexed_device_is_kept(fake_cuda):
    out = apply_memory_cap({"memory_cap_gb": 40.0}, torch.device("cuda:0"))
    assert fake_cuda == [(0.5, torch.device("cuda", 0))]  # 40 / 80
    assert out["device"] == "cuda:0"


def test_cap_at_or_above_device_memory_is_not_applied(fake_cuda):
    out = apply_memory_cap({"memory_cap_gb": 80.0}, torch.device("cuda"))
    assert fake_cuda == [] and out["applied"] is False and ">= device memory 80.0 GB" in out["cap_reason"]


def test_cpu_and_no_cap():
    assert apply_memory_cap({"memory_cap_gb": None}, torch.device("cpu")) == {"memory_cap_gb": None}
    out = apply_memory_cap({"memory_cap_gb": 8.0}, torch.device("cpu"))
    assert out["applied"] is False and "CPU" in out["cap_reason"]
