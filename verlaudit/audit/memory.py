"""Memory telemetry: device memory through NVML in a background thread, allocator peaks per phase,
host RSS as the fallback, and the allocator's view when an out-of-memory error ends a run.

`MemoryMonitor(device)` picks its source once: ``nvml`` (pynvml from nvidia-ml-py, ``used`` bytes
of the device, which includes other processes and the CUDA context) or ``rss`` (this process's
resident set, from /proc or psutil) with the reason NVML was not used. It never raises for a
missing GPU. Exercised by `pytest tests/test_audit_memory.py`.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
from collections.abc import Iterator
from typing import Any

import torch

GB = 1024**3


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:  # no /proc and no psutil: the kernel's lifetime peak is all there is
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class MemoryMonitor:
    """Samples memory every ``interval`` seconds; peaks per phase for the current step and overall."""

    def __init__(self, device: str | torch.device = "cpu", *, interval: float = 0.01) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.interval = interval
        self._handle = None
        self.reason = ""
        self.source = "rss"
        self.total_bytes: int | None = None
        self.gpu_name: str | None = None
        self.driver: str | None = None
        self._init_nvml()
        self._lock = threading.Lock()
        self._phase: str | None = None
        self.step_peak = 0
        self.phase_peaks: dict[str, int] = {}
        """Device (NVML) or RSS peak bytes per phase in the current step."""
        self.alloc_peaks: dict[str, int] = {}
        """torch.cuda max allocated bytes per phase in the current step."""
        self.overall_phase_peaks: dict[str, int] = {}
        self.overall_alloc_peaks: dict[str, int] = {}
        self.overall_peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _init_nvml(self) -> None:
        if not self.cuda:
            self.reason = (
                "no CUDA device in use: host RSS of this process instead of device memory"
                if torch.cuda.is_available()
                else "no CUDA device: host RSS of this process"
            )
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible:  # NVML numbers devices physically; CUDA after CUDA_VISIBLE_DEVICES
                ids = [x.strip() for x in visible.split(",") if x.strip()]
                if index < len(ids) and ids[index].isdigit():
                    index = int(ids[index])
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
            self.source = "nvml"
            self.reason = "NVML device memory (used bytes of the whole device)"
            self.total_bytes = int(pynvml.nvmlDeviceGetMemoryInfo(self._handle).total)
            name = pynvml.nvmlDeviceGetName(self._handle)
            self.gpu_name = name.decode() if isinstance(name, bytes) else str(name)
            drv = pynvml.nvmlSystemGetDriverVersion()
            self.driver = drv.decode() if isinstance(drv, bytes) else str(drv)
        except Exception as e:  # ImportError or any NVMLError: fall back, and say why
            self._handle = None
            self.source = "rss"
            self.reason = f"NVML unavailable ({type(e).__name__}: {e}): host RSS of this process instead"

    def sample(self) -> int:
        if self._handle is not None:
            value = int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        else:
            value = _rss_bytes()
        with self._lock:
            self.step_peak = max(self.step_peak, value)
            self.overall_peak = max(self.overall_peak, value)
            if self._phase is not None:
                self.phase_peaks[self._phase] = max(self.phase_peaks.get(self._phase, 0), value)
        return value

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> MemoryMonitor:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="verlaudit-memory", daemon=True)
            self._thread.start()
        self.sample()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=2.0)
            self._thread = None
        if self._handle is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._handle = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        previous = self._phase
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        with self._lock:
            self._phase = name
        self.sample()
        try:
            yield
        finally:
            self.sample()
            if self.cuda:
                peak = int(torch.cuda.max_memory_allocated(self.device))
                self.alloc_peaks[name] = max(self.alloc_peaks.get(name, 0), peak)
                self.overall_alloc_peaks[name] = max(self.overall_alloc_peaks.get(name, 0), peak)
            with self._lock:
                self.overall_phase_peaks[name] = max(
                    self.overall_phase_peaks.get(name, 0), self.phase_peaks.get(name, 0)
                )
                self._phase = previous

    def step_metrics(self) -> dict[str, float]:
        """The auditor's memory keys for the step just finished; resets the step peaks."""
        self.sample()
        out: dict[str, float] = {"perf/device_memory_peak_gb": self.step_peak / GB}
        if self.cuda:
            out["perf/max_memory_allocated_gb"] = (
                max([torch.cuda.max_memory_allocated(self.device), *self.alloc_peaks.values()]) / GB
            )
            out["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved(self.device) / GB
        for name, v in self.phase_peaks.items():
            out[f"memory/{name}/device_peak_gb"] = v / GB
        for name, v in self.alloc_peaks.items():
            out[f"memory/{name}/allocated_peak_gb"] = v / GB
        with self._lock:
            self.step_peak = 0
            self.phase_peaks = {}
        self.alloc_peaks = {}
        return out

    def summary(self) -> dict[str, Any]:
        """Overall peaks for the manifest."""
        return {
            "source": self.source,
            "reason": self.reason,
            "peak_gb": self.overall_peak / GB,
            "phase_peak_gb": {k: v / GB for k, v in self.overall_phase_peaks.items()},
            "phase_allocated_peak_gb": {k: v / GB for k, v in self.overall_alloc_peaks.items()},
        }

    def allocator_view(self) -> dict[str, Any]:
        """What the allocator (or the host) looked like at a failure: for status.json."""
        view: dict[str, Any] = {
            "source": self.source,
            "phase_peak_gb_so_far": {
                k: v / GB for k, v in {**self.overall_phase_peaks, **self.phase_peaks}.items()
            },
        }
        if self.cuda:
            with contextlib.suppress(Exception):
                s = torch.cuda.memory_stats(self.device)
                view.update(
                    {
                        "allocated_gb": s.get("allocated_bytes.all.current", 0) / GB,
                        "reserved_gb": s.get("reserved_bytes.all.current", 0) / GB,
                        "active_gb": s.get("active_bytes.all.current", 0) / GB,
                        "max_allocated_gb": s.get("allocated_bytes.all.peak", 0) / GB,
                        "num_alloc_retries": s.get("num_alloc_retries", 0),
                        "num_ooms": s.get("num_ooms", 0),
                    }
                )
            with contextlib.suppress(Exception):
                free, total = torch.cuda.mem_get_info(self.device)
                view["device_free_gb"], view["device_total_gb"] = free / GB, total / GB
            with contextlib.suppress(Exception):
                view["largest_free_block_gb"] = _largest_free_block(self.device) / GB
            view["allocated_peak_gb_so_far"] = {
                k: v / GB for k, v in {**self.overall_alloc_peaks, **self.alloc_peaks}.items()
            }
        else:
            view["rss_gb"] = _rss_bytes() / GB
        return view


def _largest_free_block(device: torch.device) -> int:
    """Largest inactive block inside reserved segments: what the allocator could still hand out
    without asking the driver (fragmentation shows as reserved >> allocated with a small block)."""
    best = 0
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device") not in (None, device.index if device.index is not None else 0):
            continue
        for block in seg.get("blocks", []):
            if block.get("state") == "inactive":
                best = max(best, int(block.get("size", 0)))
    return best
