"""What a suite names outside its own file, checked before any worker starts.

`preflight(suite)`: for every variant, every plug-in (`PLUGINS`, ``model.setup`` included) is imported
and its signature checked against how the trainer calls it, every model directory (``model.path``,
``model.tokenizer``, ``model.critic_path``, a ``model.reward_model`` directory) is a local Hugging
Face directory whose config or tokenizer loads (the actor's and the critic's vocabulary covering the
tokenizer's ids), verl's ``data.train_files`` exist,
``model.preset`` / ``data.task`` exist, and ``rollout.engine: vllm`` finds vLLM installed (else the
install command). A
mistake is a ValueError naming the suite file, the line and the field (``s.yaml:12:
variants.bf16.data.collator: ...``). `verlaudit run`, `verlaudit plan` and `verlaudit recommend` all call
it. Every path has been made absolute against the suite file already (`verlaudit.run.suite.resolve_paths`). Exercised by `pytest tests/test_preflight.py`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from trainer.config import TrainConfig
from verlaudit.run.suite import Suite

PLUGINS: dict[str, tuple[str, ...]] = {
    "data.dataset": (),
    "data.collator": ("examples", "tokenizer"),
    "data.reward_fn": ("prompts", "responses", "examples"),
    "model.reward_model": ("tokenizer", "device"),
    "data.compute_score": ("data_source=", "solution_str=", "ground_truth=", "extra_info="),
    "model.setup": ("model", "role", "tokenizer"),
}
"""Plug-in field -> the arguments the trainer calls it with (trainer/data.py, trainer/models.py,
trainer/verl_data.py); ``name=`` is passed by keyword (verl's compute_score, plus
``data.compute_score_kwargs``)."""


class PreflightError(ValueError):
    """A preflight problem: the one-line message, and the variants that name the refused value (the
    command writes each a refused run directory, so `verlaudit diagnose` reads why nothing ran)."""

    def __init__(self, message: str, *, variants: tuple[str, ...]) -> None:
        super().__init__(message)
        self.variants = variants


def preflight(suite: Suite) -> None:
    """Imports and checks everything the suite's variants name outside the file; `PreflightError` (a
    ValueError) naming the suite file, the line and the field at the first problem
    (``s.yaml:7: train.model.setup: ...``), and every variant that has one."""
    problems = preflight_problems(suite)
    if problems:
        first = next(iter(problems.values()))
        raise PreflightError(str(first), variants=tuple(problems))


def preflight_problems(suite: Suite) -> dict[str, PreflightError]:
    """Variant -> its first problem, each variant checked on its own (a value several variants share is
    checked once), so `verlaudit run` can refuse the variants that cannot run and start the others."""
    checked: dict[tuple[str, Any], PreflightError | None] = {}
    problems: dict[str, PreflightError] = {}
    for vname, cfg in suite.variants.items():
        for field, value, check in _checks(cfg):
            if value is None:
                continue
            if (field, value) not in checked:
                where = _where(suite, vname, field, value)
                try:
                    check(value, where)
                    checked[(field, value)] = None
                except ValueError as e:
                    checked[(field, value)] = PreflightError(
                        f"{_located(suite, where)}{e}", variants=(vname,)
                    )
            if checked[(field, value)] is not None:
                problems[vname] = checked[(field, value)]  # type: ignore[assignment]
                break
    return problems


def _located(suite: Suite, where: str) -> str:
    """``file:line: `` of the key ``where`` names (or of the nearest enclosing key written), ``file: ``
    when the suite came from no file."""
    if not suite.source:
        return ""
    parts = where.split(".")
    for n in range(len(parts), 0, -1):
        line = suite.lines.get(".".join(parts[:n]))
        if line is not None:
            return f"{suite.source}:{line}: "
    return f"{suite.source}: "


def _checks(cfg: TrainConfig) -> list[tuple[str, Any, Callable[[Any, str], None]]]:
    """(field, value, check) for what one variant names outside the suite file."""
    m, d = cfg.model, cfg.data
    verl_rows = d.train_files is not None  # verl's data: no task, dataset or reward_fn (trainer.verl_data)
    rule_reward = cfg.algo.name != "dpo" and d.reward_fn is None and m.reward_model is None and not verl_rows
    uses_task = (d.dataset is None and not verl_rows) or rule_reward
    # a table, one field per line (a value of None: nothing named, nothing to check)
    return [
        ("model.preset", m.preset if m.path is None else None, _preset),
        ("model.path", m.path, lambda v, w: _vocab(m, v, w, "a causal LM")),
        ("model.tokenizer", (m.tokenizer, m.path) if m.tokenizer or m.path else None, lambda v, w: _tokenizer(m, w)),
        ("model.critic_path", m.critic_path, lambda v, w: _vocab(m, v, w, "a model")),
        ("model.reward_model", m.reward_model, lambda v, w: _reward_model(v, w, m)),
        ("data.task", d.task if uses_task else None, _task),
        ("data.train_files", d.train_file_list or None, _data_files),
        *((field, getattr(d, field[5:]), functools.partial(_plugin, field=field))
          for field in ("data.dataset", "data.collator", "data.reward_fn")),
        ("data.compute_score", (d.compute_score, tuple(d.compute_score_kwargs)) if d.compute_score else None,
         lambda v, w: _plugin(v[0], w, field="data.compute_score", kwargs=v[1])),
        *((f"model.setup.{role}" if isinstance(m.setup, Mapping) else "model.setup", spec,
           lambda v, w: _plugin(v, w, field="model.setup")) for role, spec in m.setup_plugins().items()),
        ("rollout.engine", cfg.rollout.kind if cfg.rollout.kind == "vllm" else None, _engine),
    ]  # fmt: skip


def _engine(name: str, where: str) -> None:
    """A rollout engine that is not part of this Python (vLLM) is installed: else its install command."""
    from trainer.vllm_engine import require_vllm

    require_vllm(where)


def _where(suite: Suite, vname: str, field: str, value: Any) -> str:
    """``train.<field>`` when the value comes from the suite's base, else ``variants.<name>.<field>``."""
    base = {f: v for f, v, _ in _checks(suite.train)}
    return f"train.{field}" if base.get(field) == value else f"variants.{vname}.{field}"


def _preset(name: str, where: str) -> None:
    from trainer.models import PRESETS

    if name not in PRESETS:
        raise ValueError(
            f"{where}: unknown preset {name!r}; expected one of {', '.join(PRESETS)} (or set model.path to a "
            "local model directory)"
        )


def _task(name: str, where: str) -> None:
    from trainer.data import TASKS

    if name not in TASKS:
        raise ValueError(
            f"{where}: unknown task {name!r}; expected one of {', '.join(TASKS)}, or set data.dataset"
        )


def _data_files(files: tuple[str, ...], where: str) -> None:
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise ValueError(
            f"{where}: {', '.join(missing)} not found (a relative path is relative to the suite file); "
            "expected verl's RL data: .parquet, .jsonl or .json files"
        )


def _hf_dir(path: str, where: str, what: str) -> None:
    """A local ``save_pretrained`` directory whose config.json loads (nothing is downloaded)."""
    from transformers import AutoConfig

    want = f"a local Hugging Face directory of {what} (save_pretrained layout; nothing is downloaded)"
    if not os.path.exists(path):
        raise ValueError(
            f"{where}: {path!r} does not exist (a relative path is relative to the suite file); expected {want}"
        )
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{where}: {path!r} has no config.json; expected {want}")
    try:
        AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # any failure to read the config becomes a located message
        raise ValueError(f"{where}: {path!r}: its config.json does not load: {_one_line(e)}") from None


def _vocab(model_cfg: Any, path: str, where: str, what: str) -> None:
    """A model directory (`_hf_dir`) whose embedding covers every id of the tokenizer the run uses (the
    worker refuses it after loading the weights otherwise; here nothing is loaded but the config)."""
    from transformers import AutoConfig

    from trainer.models import load_tokenizer

    _hf_dir(path, where, what)
    vocab = getattr(AutoConfig.from_pretrained(path, local_files_only=True), "vocab_size", None)
    try:
        ids = len(load_tokenizer(model_cfg))
    except ValueError:
        return  # the tokenizer's own check (model.tokenizer) names that problem
    if isinstance(vocab, int) and vocab < ids:
        raise ValueError(
            f"{where}: {path!r} embeds {vocab} ids but the tokenizer has {ids}; use the tokenizer the model "
            "was trained with (model.tokenizer), or a checkpoint with that vocabulary"
        )


def _tokenizer(model_cfg: Any, where: str) -> None:
    """The tokenizer the worker will load (model.tokenizer, else one saved in model.path)."""
    from trainer.models import load_tokenizer

    if model_cfg.tokenizer is not None and not os.path.isdir(model_cfg.tokenizer):
        raise ValueError(
            f"{where}: {model_cfg.tokenizer!r} is not a directory; expected a tokenizer directory "
            "(tokenizer.save_pretrained layout)"
        )
    try:
        load_tokenizer(model_cfg)
    except ValueError as e:  # its message names model.tokenizer or model.path: put the variant in front
        raise ValueError(f"{where.removesuffix('model.tokenizer')}{e}") from None


def _reward_model(spec: str, where: str, model_cfg: Any = None) -> None:
    """A reward model preset, loader, or directory; a directory's embedding must cover the tokenizer's
    ids (it scores the rollout's ids, tokenized by the policy's tokenizer)."""
    from trainer.models import PRESETS

    if spec.startswith("preset:"):
        if spec.removeprefix("preset:") not in PRESETS:
            raise ValueError(
                f"{where}: unknown preset {spec!r}; expected preset:<one of {', '.join(PRESETS)}>"
            )
    elif os.path.isdir(spec):
        if model_cfg is not None:
            _vocab(model_cfg, spec, where, "a sequence-classification model")
        else:
            _hf_dir(spec, where, "a sequence-classification model")
    elif ":" in spec:
        _plugin(spec, where, field="model.reward_model")
    else:
        raise ValueError(
            f"{where}: {spec!r} is neither an existing directory, 'preset:<name>' (presets: {', '.join(PRESETS)}) "
            "nor a loader 'module:attr' / 'path/to/file.py:attr'"
        )


def _plugin(spec: str, where: str, *, field: str, kwargs: tuple[str, ...] = ()) -> None:
    """Imports a ``module:attr`` / ``file.py:attr`` plug-in as the worker will and checks that it
    accepts the arguments the trainer passes it (`PLUGINS`, plus the ``kwargs`` names the suite adds)."""
    from trainer.data import resolve_callable

    target = spec.rpartition(":")[0]
    if target.endswith(".py") and not os.path.isfile(target):
        raise ValueError(
            f"{where}: {spec!r}: file {target} not found (a file.py:attr path is relative to the suite file's "
            "directory; a module:attr is imported from the current directory or PYTHONPATH)"
        )
    with _worker_import_path():
        fn = resolve_callable(spec, where)
    params = PLUGINS[field] + tuple(f"{k}=" for k in kwargs)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without an inspectable signature: nothing to check before calling it
    positional = [p for p in params if not p.endswith("=")]
    try:
        sig.bind(*positional, **{p[:-1]: None for p in params if p.endswith("=")})
    except TypeError as e:
        name = spec.rpartition(":")[2]
        call = ", ".join(p + p[:-1] if p.endswith("=") else p for p in params)
        raise ValueError(
            f"{where}: {spec!r}: the trainer calls it as {name}({call}), which its signature "
            f"{name}{sig} does not accept ({e})"
        ) from None


@contextlib.contextmanager
def _worker_import_path() -> Iterator[None]:
    """sys.path as the worker has it: ``python -m`` puts the current directory first (the
    ``verlaudit`` console script does not), so ``module:attr`` resolves here as it will there."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]
