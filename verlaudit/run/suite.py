"""Suite YAML -> frozen, validated `Suite`: a base training config and a matrix of variants.

A suite names the model, data, algorithm, steps and seeds (``train:``, the keys of
`trainer.config.TrainConfig`; required: ``train: {}`` takes every default), the hardware the numbers
are meant for, the audit level, report and compare settings, and ``variants``: name -> partial
TrainConfig deep-merged onto ``train`` (a variant's ``key: unset`` drops an inherited key, which then
takes its default). Command-line overrides apply after the file validates. Every path the suite
names (`SUITE_PATHS`: plug-ins given as ``path/to/file.py:attr``, ``model.path``, ``model.setup``,
tokenizers, ``data.train_files``, reward models, ``model.critic_path``; ``compare.baseline``) is relative
to the suite file's directory, resolved once, here (`resolve_paths`): the configs, and so each worker's
spec, hold absolute paths, whatever the current directory; ``module:attr`` and absolute paths are kept.
`verlaudit.run.preflight` then imports and checks what the suite names. The top level is a `Section`
(`SuiteFile`) like every config section, so every mistake is a ValueError naming the file, the field
path and what is accepted; unknown keys are errors; YAML syntax errors name file:line. ``suite.expand()`` gives one `SuiteRun` per
(variant, seed). Exercised by `pytest tests/test_suite.py` and `verlaudit run suites/tiny_cpu.yaml`.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

# _Section is the config package's recursive from_dict/to_dict with field-path errors; reusing it
# keeps suite errors worded exactly like TrainConfig's.
from trainer.config import TrainConfig
from trainer.config_base import UNSET, without_unset
from trainer.config_base import Section as _Section
from verlaudit.analysis.ci.compare import CompareConfig
from verlaudit.audit.settings import LEVELS, AuditSettings
from verlaudit.run.hardware import get_target

AUDIT_LEVELS = LEVELS
"""`verlaudit.audit.settings.LEVELS`, for the runner's ``--audit-level`` choices."""
DEVICES = ("cpu", "cuda")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardwareConfig(_Section):
    target: str = "cpu"
    """GPU the numbers are meant for (`verlaudit.run.hardware.TARGETS`: ``a100-80gb``, ``v100-32gb``,
    ``h200``, ...) or ``cpu``. A smaller target than the present GPU caps usable memory; a target
    without bf16 refuses bf16 variants."""
    gpus: int = 1
    """GPUs one variant needs (data-parallel ranks, FSDP2 under torchrun). With target ``cpu``: that
    many gloo processes per variant (the multi-GPU code path, testable without GPUs)."""
    memory_gb: float | None = None
    """Usable memory per GPU in GiB, overriding the target's (e.g. to emulate a MIG slice)."""

    def __post_init__(self) -> None:
        get_target(self.target, where="target")
        if self.gpus < 1:
            raise ValueError(f"gpus: must be >= 1, got {self.gpus}")
        if self.memory_gb is not None and self.memory_gb <= 0:
            raise ValueError(f"memory_gb: must be > 0, got {self.memory_gb}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReportSettings(_Section):
    trailing_window: int = 10
    """Steps at the end of a run over which loss stability (std of actor/loss) is measured."""
    plots: bool = True
    """Write PNG plots next to report.md."""

    def __post_init__(self) -> None:
        if self.trailing_window < 1:
            raise ValueError(f"trailing_window: must be >= 1, got {self.trailing_window}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SuiteRun:
    """One process the runner starts: a variant at a seed."""

    variant: str
    seed: int
    run_name: str
    """Directory name: the variant, with ``-s<seed>`` when the suite repeats seeds."""
    config: TrainConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class Suite:
    """A validated suite. Build with `load_suite` or `Suite.from_dict`."""

    name: str
    """Report directory name (``reports/<name>/<timestamp>``)."""
    description: str = ""
    train: TrainConfig
    """The base training config every variant starts from."""
    seeds: tuple[int, ...]
    """Seeds each variant runs with; default: ``train.seed``."""
    hardware: HardwareConfig
    audit: AuditSettings
    report: ReportSettings
    compare: CompareConfig
    """Tolerances, gates and the baseline for `verlaudit compare` (which owns their meaning)."""
    variants: Mapping[str, TrainConfig]
    """Variant name -> the base with that variant's overrides merged in, in file order."""
    overrides: Mapping[str, Mapping[str, Any]]
    """Variant name -> the partial config as written (for the report and manifests)."""
    source: str | None = None
    """The YAML file the suite came from."""
    lines: Mapping[str, int] = dataclasses.field(default_factory=dict, compare=False)
    """Dotted key path (``variants.a.model.setup``) -> its line in ``source`` (`key_lines`), so a check
    made after loading (`verlaudit.run.preflight`) can name the line."""

    def expand(self) -> list[SuiteRun]:
        """One `SuiteRun` per (variant, seed), variants in suite order, seeds inner."""
        runs = []
        for variant, cfg in self.variants.items():
            for seed in self.seeds:
                name = variant if len(self.seeds) == 1 else f"{variant}-s{seed}"
                runs.append(
                    SuiteRun(
                        variant=variant, seed=seed, run_name=name, config=dataclasses.replace(cfg, seed=seed)
                    )
                )
        return runs

    def to_dict(self) -> dict[str, Any]:
        """Plain data that `Suite.from_dict` turns back into an equal suite."""
        return {
            "name": self.name,
            "description": self.description,
            "train": self.train.to_dict(),
            "seeds": list(self.seeds),
            "hardware": self.hardware.to_dict(),
            "audit": self.audit.to_dict(),
            "report": self.report.to_dict(),
            "compare": self.compare.to_dict(),
            "variants": {k: copy.deepcopy(dict(v)) for k, v in self.overrides.items()},
        }

    @classmethod
    def from_dict(cls, data: Any, *, source: str | None = None, default_name: str | None = None) -> Suite:
        """Validates plain data (a parsed YAML file); ValueError names ``source`` and the field path."""
        prefix = f"{source}: " if source else ""
        try:
            return _build(data, source=source, default_name=default_name)
        except ValueError as e:
            raise ValueError(f"{prefix}{e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SuiteFile(_Section):
    """A suite file's top level as written (`Section`: an unknown key or a wrong type names the field).
    ``train`` and ``variants`` stay plain data here: each variant is merged onto ``train`` before either
    is read as a `TrainConfig` (`_build`)."""

    name: str | None = None
    """Report directory name; default: the file's stem."""
    description: str | None = None
    train: Any = None
    """The base `TrainConfig` (required; ``train: {}`` takes every default)."""
    seeds: Any = None
    """Seeds each variant runs with; default: ``train.seed``."""
    hardware: HardwareConfig = dataclasses.field(default_factory=HardwareConfig)
    audit: AuditSettings = dataclasses.field(default_factory=AuditSettings)
    report: ReportSettings = dataclasses.field(default_factory=ReportSettings)
    compare: CompareConfig = dataclasses.field(default_factory=CompareConfig)
    variants: Any = None
    """Variant name -> partial `TrainConfig`, merged onto ``train``."""

    def __post_init__(self) -> None:
        if self.name is not None and not _NAME.match(self.name):
            raise ValueError(
                f"name: {self.name!r}; expected a name of letters, digits, '_', '-', '.' (it names a directory)"
            )
        if self.train is not None and not isinstance(self.train, Mapping):
            raise ValueError(f"train: expected a mapping of TrainConfig keys, got {self.train!r}")
        seeds = self.seeds
        if seeds is not None:
            if not isinstance(seeds, Sequence) or isinstance(seeds, str) or not seeds:
                raise ValueError(f"seeds: expected a non-empty list of integers, got {seeds!r}")
            for i, s in enumerate(seeds):
                if isinstance(s, bool) or not isinstance(s, int):
                    raise ValueError(f"seeds[{i}]: expected an integer, got {s!r}")
            if len(set(seeds)) != len(seeds):
                raise ValueError(f"seeds: repeated seed in {list(seeds)}; each seed names one run directory")
        if not isinstance(self.variants, Mapping) or not self.variants:
            raise ValueError(
                "variants: expected a non-empty mapping of variant name -> TrainConfig overrides, "
                "e.g. {fp32: {precision: {preset: fp32}}}"
            )


def _build(data: Any, *, source: str | None, default_name: str | None) -> Suite:
    if not isinstance(data, Mapping):
        keys = ", ".join(f.name for f in dataclasses.fields(SuiteFile))
        raise ValueError(f"a suite is a mapping with keys {keys}; got {type(data).__name__}")
    if "compare" in data and not isinstance(data["compare"], Mapping):
        raise ValueError(f"compare: expected a mapping (tolerances, gates), got {data['compare']!r}")
    top = SuiteFile.from_dict(data)
    name = top.name if top.name is not None else default_name
    if name is None or not _NAME.match(name):
        raise ValueError(
            f"name: {name!r}; expected a name of letters, digits, '_', '-', '.' (it names a directory)"
        )
    if top.train is None and "train" in data:
        raise ValueError("train: expected a mapping of TrainConfig keys, got None; write train: {}")
    # every path the suite names is relative to the suite file; the configs hold absolute paths
    suite_dir = Path(source).parent if source else Path.cwd()
    base = resolve_paths(TrainConfig.from_dict(top.train or {}, where="train"), suite_dir)
    variants, overrides = _variants(top.variants, top.train or {}, suite_dir)
    if top.train is None:  # checked after the sections that are there: the mistakes written come first
        raise ValueError(_NO_TRAIN)
    compare = top.compare
    if compare.baseline is not None:  # relative to the suite file, like every path it names
        compare = dataclasses.replace(compare, baseline=resolve_path(compare.baseline, suite_dir))
    return Suite(
        name=name,
        description=top.description or "",
        train=base,
        seeds=tuple(top.seeds) if top.seeds is not None else (base.seed,),
        hardware=top.hardware,
        audit=top.audit,
        report=top.report,
        compare=compare,
        variants=variants,
        overrides=overrides,
        source=source,
    )


_NO_TRAIN = (
    "train: missing; a suite names the base training config its variants start from (model, data, algo, "
    "steps), e.g. train: {model: {preset: tiny-llama}, algo: {name: ppo}, steps: 20}; write train: {} to "
    "take every default of trainer.config.TrainConfig"
)


def _variants(
    variants_raw: Mapping[Any, Any], base_raw: Mapping[str, Any], suite_dir: Path
) -> tuple[dict[str, TrainConfig], dict[str, dict[str, Any]]]:
    """Each variant's config (its overrides deep-merged onto the base as written, then read) and its
    overrides as written. A variant's ``key: unset`` drops the inherited key (it takes its default)."""
    variants: dict[str, TrainConfig] = {}
    overrides: dict[str, dict[str, Any]] = {}
    for vname, over in variants_raw.items():
        where = f"variants.{vname}"
        check_variant_name(vname, where)
        over = {} if over is None else over
        if not isinstance(over, Mapping):
            raise ValueError(f"{where}: expected a mapping of TrainConfig overrides, got {over!r}")
        if "seed" in over:
            raise ValueError(f"{where}.seed: set seeds for the whole suite with the top-level 'seeds' list")
        merged = without_unset(deep_merge(base_raw, over))
        try:
            cfg = TrainConfig.from_dict(merged, where=where)
        except ValueError as e:
            raise ValueError(_inherited_hint(str(e), where, over)) from None
        variants[vname] = resolve_paths(cfg, suite_dir)
        overrides[vname] = copy.deepcopy(dict(over))
    return variants, overrides


def check_variant_name(name: Any, where: str) -> None:
    """The variant-name rule (a variant names its run directory): ValueError naming ``where``."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"{where}: bad variant name; use letters, digits, '_', '-', '.' (it names a directory)"
        )


def _inherited_hint(msg: str, where: str, over: Mapping[str, Any]) -> str:
    """``msg``, plus how to drop the key from this variant when the key it names comes from ``train:``
    and nothing reads it under the variant's other values (a variant cannot delete an inherited key)."""
    field, _, rest = msg.partition(": ")
    if not field.startswith(where + ".") or "nothing reads it" not in rest:
        return msg
    *section, key = field[len(where) + 1 :].split(".")
    node: Any = over
    for part in (*section, key):
        if not isinstance(node, Mapping) or part not in node:
            under = ".".join((where, *section))
            return f"{msg}; it is inherited from train: write {key}: {UNSET} under {under} to drop it"
        node = node[part]
    return msg


def _abs(path: str, base: Path) -> str:
    """``path`` against ``base`` (``~`` expanded); an absolute path is kept as written."""
    p = os.path.expanduser(path)
    return p if os.path.isabs(p) else os.path.normpath(os.path.join(os.path.abspath(base), p))


def resolve_plugin(spec: Any, base: Path) -> Any:
    """A ``path/to/file.py:attr`` plug-in against ``base``; ``module:attr`` and absolute paths kept."""
    if not isinstance(spec, str) or ":" not in spec:
        return spec
    target, _, attr = spec.rpartition(":")
    return f"{_abs(target, base)}:{attr}" if target.endswith(".py") else spec


def resolve_path(path: Any, base: Path) -> Any:
    """A file or directory path against ``base``; None kept."""
    return _abs(path, base) if isinstance(path, str) and path else path


def _reward_model(spec: Any, base: Path) -> Any:
    """``model.reward_model``: ``preset:<name>`` and ``module:attr`` kept, a ``file.py:attr`` loader or a
    directory resolved."""
    if not isinstance(spec, str) or spec.startswith("preset:"):
        return spec
    if ":" in spec:  # a loader: file.py:attr resolved, module:attr kept
        return resolve_plugin(spec, base)
    return resolve_path(spec, base)


def _setup(spec: Any, base: Path) -> Any:
    if isinstance(spec, Mapping):
        return {role: resolve_plugin(s, base) for role, s in spec.items()}
    return resolve_plugin(spec, base)


def _files(files: Any, base: Path) -> Any:
    if isinstance(files, (list, tuple)):
        return tuple(resolve_path(f, base) for f in files)
    return resolve_path(files, base)


SUITE_PATHS: dict[str, Callable[[Any, Path], Any]] = {
    "model.path": resolve_path,
    "model.tokenizer": resolve_path,
    "model.critic_path": resolve_path,
    "model.reward_model": _reward_model,
    "model.setup": _setup,
    "data.train_files": _files,
    "data.dataset": resolve_plugin,
    "data.collator": resolve_plugin,
    "data.reward_fn": resolve_plugin,
    "data.compute_score": resolve_plugin,
}
"""Every ``train:`` key that names a file or directory -> how it is resolved against the suite file's
directory (`resolve_paths`); ``compare.baseline`` is resolved with `resolve_path` too."""


def resolve_paths(cfg: TrainConfig, base: Path) -> TrainConfig:
    """``cfg`` with every path it names (`SUITE_PATHS`) made absolute against ``base``, the suite file's
    directory: the one place a suite's paths are resolved, so the preflight, the planner and each
    worker (which may run anywhere) read the same files."""
    sections: dict[str, dict[str, Any]] = {}
    for key, resolve in SUITE_PATHS.items():
        section, field = key.split(".")
        value = getattr(getattr(cfg, section), field)
        new = resolve(value, base)
        if new != value:
            sections.setdefault(section, {})[field] = new
    if not sections:
        return cfg
    return dataclasses.replace(
        cfg, **{s: dataclasses.replace(getattr(cfg, s), **kw) for s, kw in sections.items()}
    )


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` onto ``base``: mappings merge key by key, anything else replaces."""
    out = copy.deepcopy(dict(base))
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML silently keeps the last one)."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, Any] = {}
    for key_node, _value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key]})", key_node.start_mark
            )
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def key_lines(text: str) -> dict[str, int]:
    """Dotted key path (``variants.a.model.setup``) -> the line it is written on, for every mapping key
    of a suite file's YAML (the preflight names the line of a key it refuses)."""
    out: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode):
                path = f"{prefix}.{key.value}" if prefix else str(key.value)
                out[path] = key.start_mark.line + 1
                walk(value, path)

    try:
        walk(yaml.compose(text, Loader=yaml.SafeLoader), "")
    except yaml.YAMLError:
        pass  # read_yaml has reported it already
    return out


def read_yaml(path: str | Path) -> Any:
    """Parsed YAML; syntax errors and duplicate keys become ValueError naming file:line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(
            f"{p}: no such suite file; shipped suites are in suites/ (e.g. suites/tiny_cpu.yaml)"
        )
    text = p.read_text(encoding="utf-8")
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark else str(p)
        raise ValueError(f"{where}: YAML error: {e.problem or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: YAML error: {e}") from None


def load_suite(
    path: str | Path,
    *,
    steps: int | None = None,
    variants: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    device: str | None = None,
    audit_level: str | None = None,
) -> Suite:
    """Reads and validates a suite file as written, then applies command-line overrides (so a valid
    ``--steps`` cannot hide an invalid ``steps:`` in the file).

    ``steps`` replaces every variant's steps; ``variants`` keeps only those (suite order);
    ``seeds`` replaces the seed list; ``device`` (``cpu``/``cuda``) sets ``train.device`` everywhere;
    ``audit_level`` replaces ``audit.level``.
    """
    p = Path(path)
    data = read_yaml(p)
    suite = Suite.from_dict(data, source=str(p), default_name=p.stem)
    changed = _overridden(data, steps=steps, seeds=seeds, device=device, audit_level=audit_level)
    if changed is not None:
        given = {"--steps": steps, "--seeds": seeds, "--device": device, "--audit-level": audit_level}
        flags = ", ".join(flag for flag, value in given.items() if value is not None)
        try:
            suite = Suite.from_dict(changed, source=str(p), default_name=p.stem)
        except ValueError as e:
            raise ValueError(f"{e} (with {flags} from the command line)") from None
    suite = dataclasses.replace(suite, lines=key_lines(p.read_text(encoding="utf-8")))
    return _keep_variants(suite, variants, p)


def _overridden(
    data: dict[str, Any],
    *,
    steps: int | None,
    seeds: Sequence[int] | None,
    device: str | None,
    audit_level: str | None,
) -> dict[str, Any] | None:
    """A copy of a validated suite's data with the command-line values in, or None without any."""
    if steps is None and seeds is None and device is None and audit_level is None:
        return None
    data = copy.deepcopy(data)
    variants = {k: (v or {}) for k, v in data["variants"].items()}
    train = data.get("train") or {}
    if steps is not None:
        if steps < 1:
            raise ValueError(f"--steps: must be >= 1, got {steps}")
        train["steps"] = steps
        variants = {k: {**v, "steps": steps} for k, v in variants.items()}
    if device is not None:
        if device not in DEVICES:
            raise ValueError(f"--device: {device!r}; expected one of {', '.join(DEVICES)}")
        train["device"] = device
        variants = {k: {kk: vv for kk, vv in v.items() if kk != "device"} for k, v in variants.items()}
    if seeds is not None:
        data["seeds"] = list(seeds)
    if audit_level is not None:
        data["audit"] = {**(data.get("audit") or {}), "level": audit_level}
    return {**data, "train": train, "variants": variants}


def _keep_variants(suite: Suite, variants: Sequence[str] | None, p: Path) -> Suite:
    if not variants:
        return suite
    unknown = [v for v in variants if v not in suite.variants]
    if unknown:
        raise ValueError(
            f"--variants: {', '.join(unknown)} not in {p}; expected some of {', '.join(suite.variants)}"
        )
    keep = [v for v in suite.variants if v in variants]
    return dataclasses.replace(
        suite,
        variants={v: suite.variants[v] for v in keep},
        overrides={v: suite.overrides[v] for v in keep},
    )
