"""Shared test setup: deterministic, single-threaded torch so 2-core CI machines are not oversubscribed,
and a fresh Inductor cache per session: the cache key leaves out ATEN_CPU_CAPABILITY, so kernels compiled
under one capability were loaded under another and crashed (a segfault in
tests/test_rollout_fast.py::test_compiled_decode_gives_the_eager_tokens under
ATEN_CPU_CAPABILITY=avx2 after a run without it); no test may depend on what the host compiled before."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="verlaudit-tests-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

import torch  # noqa: E402

torch.set_num_threads(1)
