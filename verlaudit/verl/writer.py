"""A mapped verl job -> the suite YAML that reproduces it, with every key's fate in its header.

Every path the suite names is written relative to the suite file where it can be (`suite_paths`), as
`verlaudit run` reads it; the header notes each one written absolute. The suite runs the job's own
precision as variant ``verl`` beside the ``fp32``, ``fp16``, ``bf16`` and
``bf16-pure`` presets (a preset identical to the job's own is left out, with a note). The script's
overrides, with their lines, go to ``train.origin.verl``: every run's manifest carries them, so
`verlaudit diagnose` can write a fix back as the script's own line (`verlaudit.verl.roundtrip`).
Exercised by `pytest tests/test_from_verl.py`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

from trainer.precision import PRESETS
from verlaudit.verl.context import Record
from verlaudit.verl.launch import Launch
from verlaudit.verl.mapping import Mapped

BASELINE = "verl"
"""The variant that runs the job's own precision settings."""


def origin_of(launch: Launch) -> dict[str, Any]:
    """What ``train.origin.verl`` records: the source and each override with its line."""
    return {
        "source": launch.source,
        "kind": launch.kind,
        "entry": launch.entry,
        "overrides": [o.to_dict() for o in launch.overrides],
    }


def variants_of(mapped: Mapped) -> tuple[dict[str, Any], list[str]]:
    """The baseline plus the presets not identical to it, and a note for each preset left out."""
    base = mapped.precision
    variants: dict[str, Any] = {
        BASELINE: {"precision": {"preset": base["preset"], "overrides": base["overrides"]}}
    }
    notes = []
    for preset in PRESETS:
        if preset == base["preset"] and not base["overrides"]:
            notes.append(f"variant {preset} left out: it is the job's own precision (variant {BASELINE})")
            continue
        variants[preset] = {"precision": {"preset": preset, "overrides": {}}}
    return variants, notes


PATH_KEYS = (
    ("model", "path"),
    ("model", "tokenizer"),
    ("model", "critic_path"),
    ("model", "reward_model"),
    ("data", "train_files"),
    ("data", "compute_score"),
)
"""The suite keys from-verl may write a file or directory into (a ``file.py:attr`` for the plug-ins)."""


def _below(path: str, directory: str) -> bool:
    return os.path.commonpath([path, directory]) == directory


def _relative(path: str, suite_dir: str, cwd: str) -> tuple[str, bool]:
    """``(what the suite holds, made relative)`` for a path as the script names it (relative to ``cwd``,
    where verl would run): relative to the suite's directory when the file is below it, or when both
    are inside ``cwd`` (the project from-verl runs in: ``../data/x.parquet`` holds in any clone of it);
    absolute otherwise."""
    absolute = os.path.normpath(os.path.join(cwd, os.path.expanduser(path)))
    inside = _below(absolute, suite_dir) or (
        os.path.dirname(cwd) != cwd and _below(absolute, cwd) and _below(suite_dir, cwd)
    )
    return (os.path.relpath(absolute, suite_dir), True) if inside else (absolute, False)


def suite_paths(train: dict[str, Any], out: Path, cwd: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """``train`` with its paths (`PATH_KEYS`) written relative to the suite file ``out`` where they can be
    (`_relative`), and a note naming each one that could not; ``module:attr`` and preset names are kept."""
    cwd = os.path.abspath(cwd or os.getcwd())
    suite_dir = os.path.dirname(os.path.abspath(out))
    train = {k: dict(v) if isinstance(v, dict) else v for k, v in train.items()}
    kept = []

    def one(value: str) -> str:
        target, colon, attr = value.rpartition(":") if ":" in value else (value, "", "")
        if colon and not target.endswith(".py"):
            return value  # module:attr, preset:<name>
        written, relative = _relative(target, suite_dir, cwd)
        if not relative:
            kept.append(written)
        return f"{written}{colon}{attr}"

    for section, key in PATH_KEYS:
        value = (train.get(section) or {}).get(key)
        if isinstance(value, str):
            train[section][key] = one(value)
        elif isinstance(value, (list, tuple)):
            train[section][key] = [one(v) if isinstance(v, str) else v for v in value]
    notes = [
        f"{p}: outside the suite's directory and the directory from-verl ran in, so written absolute; this "
        "suite runs only where that path exists"
        for p in kept
    ]
    return train, notes


def _line(r: Record) -> str:
    where = f"line {r.line:>3}" if r.line is not None else "default "
    head = f"{r.verl}={r.text}"
    if r.kind in ("mapped", "default"):
        value = (
            r.value if not isinstance(r.value, dict) else ", ".join(f"{k}: {v}" for k, v in r.value.items())
        )
        tail = f"-> {r.suite}: {value}" + (f"  ({r.reason})" if r.reason else "")
    else:
        tail = r.reason
    return f"#   {where}  {head:<58} {tail}"


def header(mapped: Mapped, launch: Launch, out: Path, notes: list[str]) -> str:
    groups = (
        ("mapped", "Mapped (your script's keys)"),
        ("default", "verl's defaults for keys your script leaves out, where ours differ"),
        ("consistent", "Consistent: nothing to set, this trainer already does what the key says"),
        ("unmapped", "Not mapped, with the reason"),
    )
    lines = [
        f"# Run: verlaudit run {out.as_posix()}",
        "#",
        f"# Generated by `verlaudit from-verl {launch.source}` ({launch.entry}, {len(launch.overrides)} "
        "overrides): re-run it after changing the script instead of editing this file.",
        f"# Variant {BASELINE} is your script's own precision; the others are the presets it is compared with.",
    ]
    for kind, title in groups:
        recs = [r for r in mapped.records if r.kind == kind]
        if recs:
            lines += ["#", f"# {title} ({len(recs)}):"] + [_line(r) for r in recs]
    if notes:
        lines += ["#", "# Notes:"] + [f"#   {n}" for n in notes]
    return "\n".join(lines) + "\n"


def suite_name(out: Path) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", out.stem)
    return name if name[:1].isalnum() else f"verl_{name}"


def render(mapped: Mapped, launch: Launch, out: Path, *, audit_level: str = "boundary") -> tuple[str, dict]:
    """``(yaml text, suite data)``: the suite file's text and the plain data it holds."""
    variants, variant_notes = variants_of(mapped)
    train, path_notes = suite_paths(mapped.train, out)
    train["origin"] = {"verl": origin_of(launch)}
    data = {
        "name": suite_name(out),
        "description": f"verl job {Path(launch.source).name} ({launch.entry}): its own precision and the presets",
        "train": train,
        "seeds": [0],
        "hardware": mapped.hardware,
        "audit": {"level": audit_level},
        "variants": variants,
    }
    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=110, allow_unicode=True)
    return header(mapped, launch, out, mapped.notes + path_notes + variant_notes) + body, data
