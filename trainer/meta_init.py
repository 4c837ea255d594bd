"""Build a model on the meta device, then give each rank exactly the weights one process would draw.

A sharded run should never hold a whole model per rank: each rank builds the model on the meta
device (no memory, no random draws), shards it, and materialises only its shards. But the weights
must be the ones a single process draws from the same seed, or a 2-rank run would not train the
model a 1-process run trains. So the build is recorded, then replayed:

- `record_init(build)` runs ``build()`` under ``torch.device("meta")`` with a `TorchFunctionMode`
  that writes down every initialising call on a parameter (``torch.nn.init.normal_(w, std=...)``,
  ``w.fill_(1)``, ``w[pad].zero_()``), in order. Transformers skips its weight-init pass when it
  sees the meta device (``PreTrainedModel.init_weights``); the recorder lets it run where a real
  build runs it, inside each sub-model's ``post_init``.
- `replay_init(record, device, seed, sink)` seeds the generator like the real build
  (``torch.manual_seed(seed)``) and repeats the calls in the same order on full-size tensors on
  ``device``, one parameter at a time: a value that a later call overwrites whole is drawn (so the
  random stream advances exactly as in the real build) and dropped at once, and each parameter's
  final value is handed to ``sink(name, tensor)``, which copies the rank's shard (`copy_shard_`).
  The peak is one full parameter, not the model.

A random call the recorder cannot replay (a draw into a temporary that is then copied into a
parameter, say) raises ValueError rather than give silently different weights.
Exercised by `pytest tests/test_meta_init.py` (one process) and `pytest tests/test_distributed.py`
(two gloo ranks against one process).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_FULL_WRITES = frozenset(
    "normal_ uniform_ constant_ ones_ zeros_ eye_ dirac_ xavier_uniform_ xavier_normal_ kaiming_uniform_ "
    "kaiming_normal_ trunc_normal_ orthogonal_ sparse_ fill_ zero_ random_ bernoulli_ exponential_ "
    "geometric_ log_normal_ cauchy_".split()
)
"""In-place initialisers that write every element of their tensor (torch.nn.init's and Tensor's)."""
_RANDOM = frozenset(
    "normal_ uniform_ xavier_uniform_ xavier_normal_ kaiming_uniform_ kaiming_normal_ trunc_normal_ "
    "orthogonal_ sparse_ random_ bernoulli_ exponential_ geometric_ log_normal_ cauchy_ rand randn randint "
    "randperm normal bernoulli multinomial rand_like randn_like randint_like poisson".split()
)
"""Calls that draw from the generator: a replay must repeat each one, or every later draw shifts."""
_VIEWS = frozenset({"__getitem__", "__get__", "view", "narrow", "select", "t", "transpose", "reshape"})
"""Calls whose result shares its argument's storage (``__get__`` is ``Tensor.data``)."""
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad", "detach_"})
"""In-place by name, but they change no values."""


def _name(func: Any) -> str:
    return getattr(func, "__name__", "") or str(func)


@dataclasses.dataclass(frozen=True)
class _Call:
    root: int
    """Index of the parameter (in `InitRecord.params`) the call writes."""
    views: tuple[tuple[Any, tuple, dict], ...]
    """Calls that took the written tensor from the parameter (``w[pad]``), applied in order."""
    func: Any
    args: tuple
    kwargs: dict


@dataclasses.dataclass
class InitRecord:
    """The initialising calls on a model's parameters, in the order a real build makes them."""

    params: list[tuple[str, torch.Size, torch.dtype]]
    """(name, shape, dtype) of every parameter that was written."""
    calls: list[_Call]


class _Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.keep: list[torch.Tensor] = []  # ids stay unique while the tensors live
        self.origin: dict[int, tuple[int, tuple]] = {}  # id(view) -> (id(root), views)
        self.calls: list[tuple[int, tuple, Any, tuple, dict]] = []
        self.opaque: list[tuple[int, str]] = []  # writes of computed values: (id(root), call name)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        out = func(*args, **kwargs)
        name = _name(func)
        if not args and isinstance(kwargs.get("tensor"), torch.Tensor):
            args = (kwargs.pop("tensor"),)  # torch.nn.init passes its tensor by keyword
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if first is None:
            if name in _RANDOM:
                raise ValueError(f"meta init: {name} draws into a new tensor; cannot replay it on shards")
            return out
        root, views = self.origin.get(id(first), (id(first), ()))
        if name in _VIEWS and isinstance(out, torch.Tensor):
            if id(first) not in self.origin:
                self.keep.append(first)  # the root outlives its views: its id is not reused
            self.keep.append(out)
            self.origin[id(out)] = (root, (*views, (func, args[1:], kwargs)))
        elif (
            name in _FULL_WRITES
            or name == "__setitem__"
            or (name.endswith("_") and not name.startswith("__") and name not in _NOT_WRITES)
        ):
            if any(isinstance(a, torch.Tensor) for a in (*args[1:], *kwargs.values())):
                if name in _RANDOM:
                    raise ValueError(f"meta init: {name} with a tensor argument cannot be replayed")
                self.opaque.append((root, name))  # copy_ from a computed tensor: fine for buffers only
                return out
            self.keep.append(first)
            self.calls.append((root, views, func, args[1:], kwargs))
        elif name in _RANDOM:
            raise ValueError(f"meta init: {name} on a tensor that is not a parameter cannot be replayed")
        return out


@contextlib.contextmanager
def _transformers_init_on_meta() -> Iterator[None]:
    """transformers' ``PreTrainedModel.init_weights`` skips its init pass when it sees the meta device
    (``get_torch_context_manager_or_global_device``); a real build runs that pass inside each
    sub-model's ``post_init``, between constructors, and the recording must see it there."""
    from transformers import modeling_utils

    saved = modeling_utils.get_torch_context_manager_or_global_device
    modeling_utils.get_torch_context_manager_or_global_device = lambda: None
    try:
        yield
    finally:
        modeling_utils.get_torch_context_manager_or_global_device = saved


def record_init(build: Callable[[], nn.Module]) -> tuple[nn.Module, InitRecord]:
    """``build()`` on the meta device, and the initialising calls it made on its parameters."""
    rec = _Recorder()
    with torch.device("meta"), _transformers_init_on_meta(), rec:
        model = build()
    # only the parameters the build wrote: a module built around existing ones (the critic's head
    # around the actor's backbone) records its new parameters alone
    written = {root for root, *_ in rec.calls}
    index: dict[int, int] = {}
    params = []
    for name, p in model.named_parameters():
        bad = [call for root, call in rec.opaque if root == id(p)]
        if bad:  # buffers (rotary inv_freq) are rebuilt from their config instead (`rebuild_buffers`)
            raise ValueError(
                f"meta init: {name} is written by {bad[0]} from a computed tensor; cannot replay it"
            )
        if id(p) in written:
            index[id(p)] = len(params)
            params.append((name, p.shape, p.dtype))
    calls = []
    for root, views, func, args, kwargs in rec.calls:
        if root in index:
            calls.append(_Call(root=index[root], views=views, func=func, args=args, kwargs=kwargs))
        elif _name(func) in _RANDOM:
            raise ValueError(
                f"meta init: {_name(func)} on a tensor that is not a parameter cannot be replayed"
            )
    return model, InitRecord(params=params, calls=calls)


def replay_init(
    record: InitRecord, device: torch.device, seed: int, sink: Callable[[str, torch.Tensor], None]
) -> int:
    """Repeats the recorded calls on ``device`` after ``torch.manual_seed(seed)``; ``sink(name, value)``
    gets each parameter's final full value once (the tensor is dropped after the call). Returns the
    most bytes it held at once (one parameter, or two where a value waits for a partial write)."""
    last: dict[int, int] = {}
    for i, c in enumerate(record.calls):
        last[c.root] = i
    dropped: set[int] = set()  # calls whose result the parameter's next call overwrites whole
    following: dict[int, int] = {}
    for i in range(len(record.calls) - 1, -1, -1):
        c = record.calls[i]
        nxt = following.get(c.root)
        if nxt is not None and not record.calls[nxt].views and _name(record.calls[nxt].func) in _FULL_WRITES:
            dropped.add(i)
        following[c.root] = i
    torch.manual_seed(seed)
    live: dict[int, torch.Tensor] = {}
    peak = 0
    with torch.no_grad():
        for i, c in enumerate(record.calls):
            name, shape, dtype = record.params[c.root]
            t = live.pop(c.root, None)
            if t is None:
                t = torch.empty(shape, dtype=dtype, device=device)
            peak = max(peak, t.nbytes + sum(x.nbytes for x in live.values()))
            target = t
            for func, args, kwargs in c.views:
                target = func(target, *args, **kwargs)
            c.func(target, *c.args, **c.kwargs)
            if i == last[c.root]:
                sink(name, t)
            elif i not in dropped:  # else drawn for the stream's sake: the next call rewrites it all
                live[c.root] = t
    return peak


def copy_shard_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copies this rank's part of ``full`` into ``param`` (an FSDP2 DTensor shard or a plain tensor),
    cast to the parameter's dtype, without communication."""
    with torch.no_grad():
        if hasattr(param, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor

            # src_data_rank=None: every rank holds the same full tensor and keeps its own chunk
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(full)


def rebuild_buffers(model: nn.Module, device: torch.device) -> None:
    """``to_empty`` leaves buffers (rotary ``inv_freq``) uninitialised: rebuild each module that owns
    buffers from its config on the device and copy them over."""
    for name, module in model.named_modules():
        bufs = dict(module.named_buffers(recurse=False))
        if not bufs:
            continue
        config = getattr(module, "config", None)
        if config is None:
            raise ValueError(
                f"meta init: module {name} ({type(module).__name__}) has buffers {sorted(bufs)} and no "
                "config to rebuild them from"
            )
        with torch.device(device):  # the constructors' device argument differs across versions
            fresh = type(module)(config=config)
        with torch.no_grad():
            for bname, b in bufs.items():
                b.copy_(getattr(fresh, bname))
        for attr in ("attention_scaling",):
            if hasattr(fresh, attr):
                setattr(module, attr, getattr(fresh, attr))
