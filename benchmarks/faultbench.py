"""Shared harness of the blind fault benches for ``verlaudit diagnose``: run a list of planted faults and
clean controls into run directories, diagnose each, score the first cause and the first fix against the
answers written in the bench's faults.py, and render the markdown tables.

A bench is a folder with ``faults.py`` (``CLASSES``, ``BASE``, ``AUDIT``, ``FAULTS``, ``CONTROLS``,
``by_name``), ``assets.py`` (``build_assets(dir) -> {name: path}``), ``verify.py`` (``verify_all``,
``render``) and ``plugins/`` (``own_loops.py LOOP RUN_DIR`` for items with ``loop``). Its run_blind.py is

    from faultbench import Bench, main
    sys.exit(main(Bench(here=HERE, title="Blind fault bench 3", sft_env="BLIND3_SFT_CKPT")))

Each fault is one suite (one variant, named after it) written into the work directory (``--keep DIR``, else
a temporary one) and run with ``python -m verlaudit run SUITE --out DIR --device cpu``; then
``python -m verlaudit diagnose RUN_DIR --json``. A fault is *detected* when the verdict is not clean; its
*root* is right when the first cause's title / where / kind / what has a word of every ``root_words`` group
and its where or title names one of ``culprit``; its *fix* is right when the root is right and the first
fix's suite / verl / why text has one of ``fix_words``. A control is right when its verdict is clean. A run
that fails, or a diagnose that exits non-zero (1 is its normal answer to an error verdict) or prints no
JSON, is recorded, never fatal. ``--verify`` runs the suites and the bench's verify.py checks instead (each
fault really happens), without calling diagnose. The scoring is that of benchmarks/blind_faults_2/run_blind.py.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import copy
import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


@dataclasses.dataclass
class Bench:
    """One bench folder and how its items run."""

    here: Path
    """The bench's folder (faults.py, assets.py, verify.py, plugins/)."""
    title: str
    """The report's heading."""
    sft_env: str | None = None
    """Environment variable that names the ``sft_lm`` asset for the plug-ins that load it."""
    suite_prefix: str = "blind"
    """Suite names are ``<prefix>_<item>``."""

    def module(self, name: str) -> ModuleType:
        """The bench's own ``name.py`` (imported with the bench folder first on sys.path)."""
        if str(self.here) not in sys.path:
            sys.path.insert(0, str(self.here))
        key = f"_faultbench_{self.here.name}_{name}"
        if key not in sys.modules:
            spec = importlib.util.spec_from_file_location(key, self.here / f"{name}.py")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[key] = mod
            spec.loader.exec_module(mod)
        return sys.modules[key]


def _env(bench: Bench, assets: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if bench.sft_env and assets and "sft_lm" in assets:
        env[bench.sft_env] = assets["sft_lm"]
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def merge(base: dict, over: dict) -> dict:
    """``over`` deep-merged onto a copy of ``base``."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def fill(value: Any, subs: dict[str, str]) -> Any:
    """``{name}`` placeholders in every string of ``value`` replaced from ``subs``."""
    if isinstance(value, str):
        for k, v in subs.items():
            value = value.replace("{" + k + "}", v)
        return value
    if isinstance(value, dict):
        return {k: fill(v, subs) for k, v in value.items()}
    if isinstance(value, list):
        return [fill(v, subs) for v in value]
    return value


def suite_for(bench: Bench, item: dict, assets: dict[str, str]) -> dict:
    """The suite of one fault or control: the algorithm's base with the item's train keys merged in."""
    F = bench.module("faults")
    subs = {"plugins": str(bench.here / "plugins"), **{f"assets.{k}": v for k, v in assets.items()}}
    train = fill(merge(F.BASE[item["algo"]], item["train"]), subs)
    if train["model"].get("path"):
        train["model"].pop("preset", None)
    variant = {"precision": {"preset": item["preset"]}}
    return {
        "name": f"{bench.suite_prefix}_{item['name']}",
        "description": f"{bench.title.lower()}: " + item["name"],
        "train": train,
        "seeds": [train.get("seed", 0)],  # the top-level list wins over train.seed
        "hardware": {"target": "cpu"},
        "audit": copy.deepcopy(F.AUDIT[item["algo"]]),
        "report": {"trailing_window": 2, "plots": False},
        "variants": {item["name"]: merge(variant, item.get("variant", {}))},
    }


def run_dir(work: Path, name: str) -> Path:
    return work / "runs" / name / name


def run_item(bench: Bench, item: dict, work: Path, assets: dict[str, str], timeout: int) -> dict:
    """Writes and runs the item's suite (or own loop); returns what happened (never raises for a failed run)."""
    name = item["name"]
    out = work / "runs" / name
    if out.exists():  # `verlaudit run --out` wants a new directory
        shutil.rmtree(out)
    log = work / "logs" / f"{name}.run.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    if item.get("loop"):
        out.mkdir(parents=True)
        cmd = [PY, str(bench.here / "plugins" / "own_loops.py"), item["loop"], str(run_dir(work, name))]
    else:
        suite_path = work / "suites" / f"{name}.yaml"
        suite_path.parent.mkdir(parents=True, exist_ok=True)
        suite_path.write_text(yaml.safe_dump(suite_for(bench, item, assets), sort_keys=False))
        cmd = [PY, "-m", "verlaudit", "run", str(suite_path), "--out", str(out), "--device", "cpu",
               "--no-progress"]  # fmt: skip
    t0 = time.time()
    try:
        with open(log, "w") as fh:
            rc = subprocess.run(
                cmd, cwd=ROOT, env=_env(bench, assets), stdout=fh, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    rd = run_dir(work, name)
    return {"name": name, "run_rc": rc, "run_s": round(time.time() - t0, 1), "run_dir": str(rd),
            "has_run_dir": rd.is_dir(), "state": state(rd)}  # fmt: skip


def state(rd: Path) -> str:
    """The run's status.json state, ``missing`` or ``unreadable``."""
    p = rd / "status.json"
    if not p.is_file():
        return "missing"
    try:
        return json.loads(p.read_text()).get("state", "missing")
    except ValueError:
        return "unreadable"


def diagnose(bench: Bench, rd: Path, work: Path, name: str, timeout: int = 300) -> dict:
    """``verlaudit diagnose RUN_DIR --json`` -> its parsed JSON, or {"error": ...}."""
    if not rd.is_dir():
        return {"error": "no run directory"}
    cmd = [PY, "-m", "verlaudit", "diagnose", str(rd), "--json"]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=_env(bench), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": "diagnose timed out"}
    (work / "logs" / f"{name}.diagnose.json").write_text(p.stdout)
    (work / "logs" / f"{name}.diagnose.err").write_text(p.stderr)
    try:
        data = json.loads(p.stdout)
    except ValueError:
        start = p.stdout.find("{")
        try:
            data = json.loads(p.stdout[start:]) if start >= 0 else None
        except ValueError:
            data = None
    if not isinstance(data, dict):
        return {"error": f"diagnose exit {p.returncode}, no JSON ({p.stderr.strip()[-200:]})"}
    data["_rc"] = p.returncode
    return data


def _text(v: Any) -> str:
    if v is None:
        return ""
    return v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)


def first_diagnosis(data: dict) -> dict:
    diags = data.get("diagnoses")
    if isinstance(diags, list) and diags:
        return diags[0] if isinstance(diags[0], dict) else {}
    return data


def score(item: dict, data: dict) -> dict:
    """detected / root / fix for a fault, clean for a control, from diagnose's JSON."""
    if "error" in data:
        return {"verdict": "n/a", "detected": False, "root": False, "fix": False, "clean": False,
                "title": data["error"], "sev_ok": False}  # fmt: skip
    d = first_diagnosis(data)
    verdict = d.get("verdict") or data.get("verdict") or "n/a"
    causes = d.get("causes") or []
    cause = causes[0] if causes and isinstance(causes[0], dict) else {}
    out = {"verdict": verdict, "detected": verdict not in ("clean", "n/a"), "clean": verdict == "clean",
           "title": _text(cause.get("title")), "where": _text(cause.get("where"))}  # fmt: skip
    if "root_words" not in item:
        return out
    text = " ".join(_text(cause.get(k)) for k in ("title", "where", "kind", "what")).lower()
    place = " ".join(_text(cause.get(k)) for k in ("where", "title")).lower()
    words_ok = all(any(w.lower() in text for w in group) for group in item["root_words"])
    culprit_ok = any(c.lower() in place for c in item["culprit"])
    out["root"] = bool(cause) and words_ok and culprit_ok
    out["root_words_ok"], out["culprit_ok"] = words_ok, culprit_ok
    fixes = cause.get("fixes") or []
    fix = fixes[0] if fixes and isinstance(fixes[0], dict) else {}
    fix_text = " ".join(_text(fix.get(k)) for k in ("suite", "verl", "why")).lower()
    out["fix"] = out["root"] and any(w.lower() in fix_text for w in item["fix_words"])
    sev = _text(cause.get("severity")) or verdict
    out["sev_ok"] = sev == item["severity"]
    return out


def _mark(v: bool) -> str:
    return "yes" if v else "no"


def _cell(s: str, n: int = 70) -> str:
    s = " ".join(str(s).split()).replace("|", "/")
    return s if len(s) <= n else s[: n - 1] + "…"


def _count(rs: list[dict], key: str) -> int:
    return sum(r["score"].get(key, False) for r in rs)


def report(bench: Bench, results: list[dict], elapsed: float) -> str:
    """The markdown tables: totals, per class, per fault, per control."""
    classes = bench.module("faults").CLASSES
    faults = [r for r in results if "root_words" in r["item"]]
    controls = [r for r in results if "root_words" not in r["item"]]
    lines = [f"# {bench.title}", "", f"{len(faults)} faults, {len(controls)} controls, {elapsed:.0f} s.", ""]
    if faults:
        n = len(faults)
        lines += [f"**Faults**: detected {_count(faults, 'detected')}/{n}, root cause right "
                  f"{_count(faults, 'root')}/{n}, fix right {_count(faults, 'fix')}/{n} "
                  f"(severity as expected {_count(faults, 'sev_ok')}/{n}).", ""]  # fmt: skip
        lines += ["| class | detected | root | fix |", "|---|---|---|---|"]
        for c, cname in classes.items():
            rs = [r for r in faults if r["item"]["cls"] == c]
            if rs:
                lines.append(f"| {c}. {cname} ({len(rs)}) | {_count(rs, 'detected')} | {_count(rs, 'root')} | "
                             f"{_count(rs, 'fix')} |")  # fmt: skip
        lines += ["", "| fault | cls | point | algo | preset | run | verdict | detected | root (words/culprit) "
                  "| fix | sev | first cause |", "|" + "---|" * 12]  # fmt: skip
        for r in faults:
            it, s, run = r["item"], r["score"], r["run"]
            rw = f"{_mark(s.get('root', False))} ({_mark(s.get('root_words_ok', False))}/{_mark(s.get('culprit_ok', False))})"
            lines.append(
                f"| {it['name']} | {it['cls']} | {it['point']} | {it['algo']} | {it['preset']} | {run['state']} | "
                f"{s['verdict']} | {_mark(s['detected'])} | {rw} | {_mark(s.get('fix', False))} | "
                f"{it['severity']}{'' if s.get('sev_ok') else ' (x)'} | {_cell(s.get('title', ''))} |"
            )
    if controls:
        lines += ["", f"**Controls**: clean {_count(controls, 'clean')}/{len(controls)}.", "",
                  "| control | algo | preset | run | verdict | right | first cause |", "|" + "---|" * 7]  # fmt: skip
        for r in controls:
            it, s, run = r["item"], r["score"], r["run"]
            lines.append(
                f"| {it['name']} | {it['algo']} | {it['preset']} | {run['state']} | {s['verdict']} | "
                f"{_mark(s['clean'])} | {_cell(s.get('title', ''))} |"
            )
    return "\n".join(lines) + "\n"


def select(bench: Bench, only: str | None, controls: bool) -> list[dict]:
    """The items to run: all (faults, then controls unless ``controls`` is false) or the ``--only`` names."""
    F = bench.module("faults")
    items = F.FAULTS + (F.CONTROLS if controls else [])
    if not only:
        return items
    names = [n.strip() for n in only.split(",") if n.strip()]
    table = F.by_name()
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"--only: unknown {', '.join(unknown)}; known: {', '.join(table)}")
    return [table[n] for n in names]


def main(bench: Bench, argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=f"{bench.title}: run, diagnose and score planted faults")
    ap.add_argument("--only", help="comma-separated fault / control names")
    ap.add_argument("--keep", help="work directory to keep (suites, runs, logs); default: a temporary one")
    ap.add_argument("--out", help="write the markdown report here")
    ap.add_argument("--jobs", type=int, default=1, help="suites run at once (default 1: CPU is shared)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per suite run")
    ap.add_argument("--no-controls", action="store_true", help="faults only")
    ap.add_argument("--verify", action="store_true", help="run and check each fault happens; no diagnose")
    ap.add_argument("--rescore", metavar="DIR", help="diagnose and score the runs already in a --keep DIR")
    ap.add_argument("--reuse", action="store_true", help="with --verify --keep: check the runs already there")
    args = ap.parse_args(argv)
    if args.reuse and not (args.verify and args.keep):
        ap.error("--reuse needs --verify and --keep DIR")

    items = select(bench, args.only, controls=not args.no_controls)
    tmp = None
    if args.rescore:
        work = Path(args.rescore).resolve()
    elif args.keep:
        work = Path(args.keep).resolve()
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix=f"{bench.here.name}_")
        work = Path(tmp.name)
    t0 = time.time()
    assets = bench.module("assets").build_assets(work / "assets")
    if args.rescore or args.reuse:
        runs = {it["name"]: {"name": it["name"], "state": state(run_dir(work, it["name"])),
                             "run_dir": str(run_dir(work, it["name"]))} for it in items}  # fmt: skip
    else:
        runs = {}
        with cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futs = {pool.submit(run_item, bench, it, work, assets, args.timeout): it for it in items}
            for fut in cf.as_completed(futs):
                r = fut.result()
                runs[r["name"]] = r
                print(f"ran {r['name']}: {r['state']} (exit {r['run_rc']}, {r['run_s']} s)", flush=True)
    if args.verify:
        V = bench.module("verify")
        text = V.render(V.verify_all(items, work, assets, runs), time.time() - t0)
    else:
        results = []
        for it in items:
            data = diagnose(bench, Path(runs[it["name"]]["run_dir"]), work, it["name"])
            results.append({"item": it, "run": runs[it["name"]], "score": score(it, data)})
        text = report(bench, results, time.time() - t0)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if tmp is not None:
        tmp.cleanup()
    return 0
