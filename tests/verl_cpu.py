"""Test scaffolding to drive verl's own FSDP training worker on a CPU, without Ray or a rollout engine
(used by `tests/test_integrations_verl.py`).

verl 0.9.1 has no CPU platform: it falls back to ``nvidia`` and calls ``torch.cuda``. `CPUPlatform`
registers one through verl's own platform registry (`set_platform`), answering for ``torch.cpu``
with no-op memory counters; `engine_env` makes verl's engine registry pick the FSDP engine it
registers for CUDA (``VERL_ENGINE_DEVICE`` / ``VERL_ENGINE_VENDOR``), and the caller initialises a
one-rank gloo process group first (verl's own init asks for NCCL on every device).
"""

from __future__ import annotations

import contextlib
import types

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import set_platform


def _zero(*args, **kwargs):
    return 0


def _none(*args, **kwargs):
    return None


CPU_MODULE = types.SimpleNamespace(
    **{
        n: getattr(torch.cpu, n)
        for n in (
            "device_count",
            "is_available",
            "synchronize",
            "set_device",
            "Stream",
            "Event",
            "stream",
            "current_stream",
        )
    },
    current_device=lambda: "cpu",
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
    empty_cache=_none,
    memory_allocated=_zero,
    memory_reserved=_zero,
    max_memory_allocated=_zero,
    max_memory_reserved=_zero,
    reset_peak_memory_stats=_none,
    mem_get_info=lambda *a, **k: (0, 0),
    get_device_name=lambda *a, **k: "CPU",
    get_rng_state=torch.get_rng_state,
    set_rng_state=torch.set_rng_state,
    is_bf16_supported=lambda *a, **k: True,
)


class CPUPlatform(PlatformBase):
    device_name = "cpu"
    vendor_name = "cpu"
    device_module = CPU_MODULE

    def is_available(self):
        return True

    def current_device(self):
        return "cpu"  # verl moves modules to get_device_id(): an index would mean an accelerator

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return (None, None)

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None


def use_cpu() -> None:
    set_platform(CPUPlatform())


ENGINE_ENV = {
    "VERL_ENGINE_DEVICE": "cuda",
    "VERL_ENGINE_VENDOR": "nvidia",
    "RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
}
