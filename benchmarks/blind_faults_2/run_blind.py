"""Second blind fault bench for ``verlaudit diagnose``: run every planted fault and clean control, diagnose each
run directory, score the first cause and the first fix against the answers written in faults.py.

    python benchmarks/blind_faults_2/run_blind.py [--only a,b] [--keep DIR] [--out FILE] [--jobs N]
    python benchmarks/blind_faults_2/run_blind.py --verify [--only a,b] [--keep DIR]   # no diagnose
    python benchmarks/blind_faults_2/run_blind.py --rescore DIR [--out FILE]             # diagnose kept runs

Each fault is one suite (one variant, named after it) written into the work directory
(``--keep DIR``, else a temporary one) and run with ``python -m verlaudit run SUITE --out DIR --device cpu``;
then ``python -m verlaudit diagnose RUN_DIR --json``. An item with ``loop`` runs
``plugins/own_loops.py LOOP RUN_DIR`` instead (a user's own loop under ``verlaudit.watch``). A fault is *detected* when the verdict is not clean;
its *root* is right when the first cause's title / where / kind / what has a word of every ``root_words``
group and its where or title names one of ``culprit``; its *fix* is right when the root is right and the
first fix's suite / verl / why text has one of ``fix_words``. A control is right when its verdict is clean.
A run that fails, or a diagnose that exits non-zero (1 is its normal answer to an error verdict) or prints
no JSON, is recorded, never fatal. ``--verify`` runs the suites and the checks of verify.py instead
(each fault really happens), without calling diagnose.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import faults as F  # noqa: E402

PY = sys.executable


SFT_ENV = "BLIND2_SFT_CKPT"
"""Names the SFT checkpoint for the plug-ins that load it (model_setup.py, own_loops.py)."""


def _env(assets: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if assets and "sft_lm" in assets:
        env[SFT_ENV] = assets["sft_lm"]
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _fill(value: Any, subs: dict[str, str]) -> Any:
    if isinstance(value, str):
        for k, v in subs.items():
            value = value.replace("{" + k + "}", v)
        return value
    if isinstance(value, dict):
        return {k: _fill(v, subs) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, subs) for v in value]
    return value


def suite_for(item: dict, assets: dict[str, str]) -> dict:
    """The suite of one fault or control: the algorithm's base with the item's train keys merged in."""
    subs = {"plugins": str(HERE / "plugins"), **{f"assets.{k}": v for k, v in assets.items()}}
    train = _fill(_merge(F.BASE[item["algo"]], item["train"]), subs)
    if train["model"].get("path"):
        train["model"].pop("preset", None)
    return {
        "name": f"blind_{item['name']}",
        "description": "blind fault bench: " + item["name"],
        "train": train,
        "seeds": [train.get("seed", 0)],  # the top-level list wins over train.seed
        "hardware": {"target": "cpu"},
        "audit": copy.deepcopy(F.AUDIT[item["algo"]]),
        "report": {"trailing_window": 2, "plots": False},
        "variants": {item["name"]: {"precision": {"preset": item["preset"]}}},
    }


def run_dir(work: Path, name: str) -> Path:
    return work / "runs" / name / name


def run_item(item: dict, work: Path, assets: dict[str, str], timeout: int) -> dict:
    """Writes and runs the item's suite; returns what happened (never raises for a failed run)."""
    name = item["name"]
    out = work / "runs" / name
    if out.exists():  # `verlaudit run --out` wants a new directory
        shutil.rmtree(out)
    log = work / "logs" / f"{name}.run.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    if item.get("loop"):
        out.mkdir(parents=True)
        cmd = [PY, str(HERE / "plugins" / "own_loops.py"), item["loop"], str(run_dir(work, name))]
    else:
        suite_path = work / "suites" / f"{name}.yaml"
        suite_path.parent.mkdir(parents=True, exist_ok=True)
        suite_path.write_text(yaml.safe_dump(suite_for(item, assets), sort_keys=False))
        cmd = [PY, "-m", "verlaudit", "run", str(suite_path), "--out", str(out), "--device", "cpu",
               "--no-progress"]  # fmt: skip
    t0 = time.time()
    try:
        with open(log, "w") as fh:
            rc = subprocess.run(
                cmd, cwd=ROOT, env=_env(assets), stdout=fh, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    rd = run_dir(work, name)
    status = {}
    if (rd / "status.json").is_file():
        try:
            status = json.loads((rd / "status.json").read_text())
        except ValueError:
            status = {"state": "unreadable"}
    return {"name": name, "run_rc": rc, "run_s": round(time.time() - t0, 1), "run_dir": str(rd),
            "has_run_dir": rd.is_dir(), "state": status.get("state", "missing")}  # fmt: skip


def diagnose(rd: Path, work: Path, name: str, timeout: int = 300) -> dict:
    """``verlaudit diagnose RUN_DIR --json`` -> its parsed JSON, or {"error": ...}."""
    if not rd.is_dir():
        return {"error": "no run directory"}
    cmd = [PY, "-m", "verlaudit", "diagnose", str(rd), "--json"]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
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


def report(results: list[dict], elapsed: float) -> str:
    faults = [r for r in results if "root_words" in r["item"]]
    controls = [r for r in results if "root_words" not in r["item"]]
    lines = ["# Blind fault bench 2", "",
             f"{len(faults)} faults, {len(controls)} controls, {elapsed:.0f} s.", ""]  # fmt: skip
    if faults:
        n = len(faults)
        det = sum(r["score"]["detected"] for r in faults)
        root = sum(r["score"].get("root", False) for r in faults)
        fix = sum(r["score"].get("fix", False) for r in faults)
        sev = sum(r["score"].get("sev_ok", False) for r in faults)
        lines += [f"**Faults**: detected {det}/{n}, root cause right {root}/{n}, fix right {fix}/{n} "
                  f"(severity as expected {sev}/{n}).", ""]  # fmt: skip
        lines += ["| class | detected | root | fix |", "|---|---|---|---|"]
        for c, cname in F.CLASSES.items():
            rs = [r for r in faults if r["item"]["cls"] == c]
            if rs:
                lines.append(
                    f"| {c}. {cname} ({len(rs)}) | {sum(r['score']['detected'] for r in rs)} | "
                    f"{sum(r['score'].get('root', False) for r in rs)} | {sum(r['score'].get('fix', False) for r in rs)} |"
                )
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
        ok = sum(r["score"]["clean"] for r in controls)
        lines += ["", f"**Controls**: clean {ok}/{len(controls)}.", "",
                  "| control | algo | preset | run | verdict | right | first cause |", "|" + "---|" * 7]  # fmt: skip
        for r in controls:
            it, s, run = r["item"], r["score"], r["run"]
            lines.append(
                f"| {it['name']} | {it['algo']} | {it['preset']} | {run['state']} | {s['verdict']} | "
                f"{_mark(s['clean'])} | {_cell(s.get('title', ''))} |"
            )
    return "\n".join(lines) + "\n"


def _select(only: str | None, controls: bool) -> list[dict]:
    items = F.FAULTS + (F.CONTROLS if controls else [])
    if not only:
        return items
    names = [n.strip() for n in only.split(",") if n.strip()]
    table = F.by_name()
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"--only: unknown {', '.join(unknown)}; known: {', '.join(table)}")
    return [table[n] for n in names]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated fault / control names")
    ap.add_argument("--keep", help="work directory to keep (suites, runs, logs); default: a temporary one")
    ap.add_argument("--out", help="write the markdown report here")
    ap.add_argument("--jobs", type=int, default=1, help="suites run at once (default 1: CPU is shared)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per suite run")
    ap.add_argument("--no-controls", action="store_true", help="faults only")
    ap.add_argument("--verify", action="store_true", help="run and check each fault happens; no diagnose")
    ap.add_argument("--rescore", metavar="DIR", help="diagnose and score the runs already in a --keep DIR")
    args = ap.parse_args(argv)

    items = _select(args.only, controls=not args.no_controls)
    tmp = None
    if args.rescore:
        work = Path(args.rescore).resolve()
    elif args.keep:
        work = Path(args.keep).resolve()
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="blind_faults_2_")
        work = Path(tmp.name)
    from assets import build_assets

    t0 = time.time()
    assets = build_assets(work / "assets")
    if args.rescore:
        runs = {it["name"]: {"name": it["name"], "state": _state(run_dir(work, it["name"])),
                             "run_dir": str(run_dir(work, it["name"]))} for it in items}  # fmt: skip
    else:
        runs = {}
        with cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futs = {pool.submit(run_item, it, work, assets, args.timeout): it for it in items}
            for fut in cf.as_completed(futs):
                r = fut.result()
                runs[r["name"]] = r
                print(f"ran {r['name']}: {r['state']} (exit {r['run_rc']}, {r['run_s']} s)", flush=True)

    if args.verify:
        import verify as V

        rows = V.verify_all(items, work, assets, runs)
        text = V.render(rows, time.time() - t0)
    else:
        results = []
        for it in items:
            data = diagnose(Path(runs[it["name"]]["run_dir"]), work, it["name"])
            results.append({"item": it, "run": runs[it["name"]], "score": score(it, data)})
        text = report(results, time.time() - t0)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if tmp is not None:
        tmp.cleanup()
    return 0


def _state(rd: Path) -> str:
    try:
        return json.loads((rd / "status.json").read_text()).get("state", "missing")
    except (OSError, ValueError):
        return "missing"


if __name__ == "__main__":
    sys.exit(main())
