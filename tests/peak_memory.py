"""Peak CPU memory of a piece of work, from the profiler's allocation events (every tensor the c10
allocator hands out and takes back, autograd's saved tensors included), for the tests that check the
audit does not keep tensors alive: `tests/test_audit_opcount.py`, `tests/test_audit_shadow.py`.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile


def peak_bytes(fn: Callable[[], object]) -> int:
    """The largest number of bytes allocated at once while ``fn`` runs, above what was allocated
    when it started. Garbage collection is off meanwhile: a tensor kept alive by a reference cycle
    counts until the work ends, however the collector's thresholds happen to fall."""
    was = gc.isenabled()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    finally:
        if was:
            gc.enable()
        gc.collect()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    now = most = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        now += e.nbytes()
        most = max(most, now)
    return most
