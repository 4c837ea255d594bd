"""Causes from how a run ended: status.json's failure (an exception, a user error naming its suite
field, an OOM through `verlaudit.analysis.diagnose.oom`, an interrupt, a refusal) and, for a worker killed
without a status, the runner's record (runner.json: the exit code, a negative one being the signal)
with the last phase the worker started (events.jsonl ``phase_start``). Pure functions RunDir ->
causes, stamped with step, phase and role for the root-cause rules.
Exercised by `pytest tests/test_diagnose.py tests/test_root_cause.py -k killed`.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

from verlaudit import verl_keys as V
from verlaudit.analysis import logs
from verlaudit.analysis.causes import Cause, Fix
from verlaudit.analysis.diagnose.oom import oom_cause
from verlaudit.analysis.diagnose.rules import LAST
from verlaudit.analysis.diagnose.runview import cfg, last_phase_started, last_step, runner_record
from verlaudit.analysis.logs.lines import parse_frame
from verlaudit.rundir import RunDir


# long: one branch per way a run can end, read against status.json and runner.json
def status_causes(run: RunDir) -> list[Cause]:
    st = run.status or {}
    reason = st.get("reason")
    step, phase, error = st.get("step"), st.get("phase"), str(st.get("error") or "")
    at = f"step {step}" + (f", phase {phase}" if phase else "") if step is not None else "setup"
    if run.state == "killed":
        return [_killed_cause(run)]
    if run.state == "empty":
        return [
            Cause(
                "error",
                "killed",
                "Nothing was written",
                "The run directory is empty: the worker never started.",
                score=40.0,
            )
        ]
    if run.state == "completed":
        return []
    if reason == "oom":
        return [oom_cause(run)]
    if reason == "interrupted":
        return [
            Cause(
                "warning",
                "interrupted",
                f"Interrupted at {at}",
                "The run was stopped (Ctrl-C or SIGTERM); everything before it is kept.",
                evidence=[error] if error else [],
                step=step,
                phase=phase,
                seq=LAST,
            )
        ]
    if reason == "preflight":
        return [_preflight_cause(error)]
    if reason == "refused":
        return [
            Cause(
                "error",
                "refused",
                "Refused before starting",
                error or "the runner refused this variant",
                evidence=[error] if error else [],
                fixes=[
                    Fix(
                        "variants.<name>.precision.preset: fp16",
                        V.PARAM_DTYPE_FP16,
                        "the target GPU has no bf16: fp16 autocast with dynamic loss scaling runs there",
                    )
                ],
                step=step,
                score=40.0,
            )
        ]
    if reason in ("nonfinite", "dtype_error") or "probability tensor contains" in error:
        return []  # explained by _nonfinite_causes / _dtype_causes, which read the same status

    known = error_text_causes(st)
    if known:
        return known
    field = _field_in(error)
    spec = cfg(run, *field.split(".")[:2]) if field else None
    named = f"{field} ({spec})" if field and isinstance(spec, str) else field
    where = named or st.get("where") or _user_frame(st.get("traceback"))
    fixes = []
    if field:  # a user error names the suite field and says what to do (trainer.config, trainer.data)
        fixes.append(Fix(named, None, error.split(": ", 2)[-1]))
    elif where and where == _user_frame(st.get("traceback")):
        plugin = _plugin_of(run, where)
        if plugin:
            where = f"{plugin} at {where}"
        fixes.append(Fix(plugin, None, f"the exception was raised in your own code, {where}: fix it there"))
    title = f"Failed with an exception at {at}" + (f" in {where}" if where else "")
    frame = _user_frame(st.get("traceback"))
    if frame and where and frame not in where and not field:
        # rank12: raised in a module, called from the user's own code: that line is the culprit to name
        title += f" (raised through your code at {frame})"
        if not fixes:
            advice = " ".join(_ADVICE.findall(error))
            fixes.append(
                Fix(
                    _plugin_of(run, frame),
                    None,
                    f"at {frame}: " + (advice or "the call from your code raised: fix it there"),
                )
            )
    evidence = [_last_frame(st.get("traceback"))]
    if step is None and cfg(run, "model", "setup"):  # failed in setup, after the user's model code ran
        evidence.append(f"model.setup ran on the models before it: {cfg(run, 'model', 'setup')}")
    return [
        Cause(
            "error",
            "exception",
            title,
            error or "an exception with no message",
            evidence=evidence,
            fixes=fixes,
            step=step,
            where=where,
            score=30.0,
            phase=phase,
            role=st.get("role"),
            seq=LAST,
        )
    ]


_PREFLIGHT = re.compile(
    r"^(?:.*?:\d+: )?(?:train|variants\.[\w-]+)\.((?:model|data|algo|precision|rollout)\.[\w.]+): "
)


def _preflight_cause(error: str) -> Cause:
    """A variant `verlaudit run` refused before any worker started (`verlaudit.run.preflight`): its
    one-line error names the suite file, line and key, and says what to do after the ``;``."""
    m = _PREFLIGHT.match(error)
    key = m.group(1) if m else None
    what = error[m.end() :] if m else error
    problem, _, todo = what.partition("; ")
    return Cause(
        "error",
        "preflight",
        f"Refused before starting: {key}: {problem}" if key else f"Refused before starting: {problem}",
        error,
        evidence=[error],
        fixes=[Fix(key, None, todo or problem)],
        where=key,
        score=40.0,
    )


def error_text_causes(st: dict[str, Any]) -> list[Cause]:
    """The causes the log rules' families (`verlaudit.analysis.logs.explain_text`: dtype, device,
    compile, OOM, import, ... messages) recognise in a run's recorded error and traceback (status.json),
    stamped with the run's step, phase and role. The phase is the one the run recorded; where it
    recorded none, the trainer phase the frames show."""
    text = str(st.get("error") or "") + "\n" + str(st.get("traceback") or "")
    causes = logs.explain_text(text)
    for c in causes:
        c.step, c.role, c.seq = st.get("step"), st.get("role"), LAST
        c.phase = st.get("phase") or c.phase
        c.line = c.rank = None  # a line of status.json's text is no moment of the run
    return causes


_FIELD = re.compile(r"^(?:\w+(?:Error|Exception): )?((?:model|data|algo|precision|rollout)\.[\w.]+): ")


def _field_in(error: str) -> str | None:
    """The suite field a user error names first (``ValueError: data.reward_fn: returned shape ...``)."""
    m = _FIELD.match(error)
    return m.group(1) if m else None


def _last_frame(tb: Any) -> str:
    lines = [ln.strip() for ln in str(tb or "").splitlines() if ln.strip().startswith("File ")]
    return f"innermost frame: {lines[-1]}" if lines else "no traceback recorded"


_ADVICE = re.compile(r"(?:To work around this|Please|You can|you can|Try|Consider)\b[^.]*\.")
"""The sentences of an error message that say what to do (PyTorch's errors often end with their own advice)."""


def _user_frame(tb: Any) -> str | None:
    """The innermost traceback frame (`verlaudit.analysis.logs.lines.parse_frame`) outside torch,
    transformers, the trainer and the standard library: where user code (a plug-in) raised, as
    ``file.py:line in fn``."""
    frames = [f for f in map(parse_frame, str(tb or "").splitlines()) if f]
    for f in reversed(frames):
        if any(part in f.path for part in ("site-packages", "/trainer/", "/verlaudit/", "/lib/python")):
            continue
        if f.func in ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"):
            continue  # a comprehension's own frame: the function it is in is the next one out
        return f"{Path(f.path).name}:{f.lineno} in {f.func}"
    return None


_PLUGIN_KEYS = (
    ("data", "reward_fn"),
    ("data", "collator"),
    ("data", "dataset"),
    ("data", "compute_score"),
    ("model", "reward_model"),
)


def _plugin_of(run: RunDir, frame: str) -> str | None:
    """``key (spec)`` of the plug-in whose file the raising frame (``file.py:line in fn``) is in, by file
    name and, when several keys share the file, by the function the spec names."""
    file, _, rest = frame.partition(":")
    func = rest.partition(" in ")[2]
    specs = [(".".join(k), cfg(run, *k)) for k in _PLUGIN_KEYS]
    setup = cfg(run, "model", "setup")
    if isinstance(setup, dict):
        specs += [(f"model.setup.{role}", spec) for role, spec in setup.items()]
    elif setup:
        specs.append(("model.setup", setup))
    hits = [(k, v) for k, v in specs if isinstance(v, str) and _spec_file(v) == file]
    best = [(k, v) for k, v in hits if v.rpartition(":")[2] == func] or hits
    return f"{best[0][0]} ({best[0][1]})" if best else None


def _spec_file(spec: str) -> str:
    """The file name a ``path/file.py:attr`` or ``package.module:attr`` spec's code is in."""
    target = spec.rpartition(":")[0]
    return Path(target).name if target.endswith(".py") else target.rpartition(".")[2] + ".py"


_SIGNAL_WHAT = {
    "SIGKILL": "SIGKILL cannot be caught, so nothing was recorded. It is what the kernel's OOM killer sends when host "
    "RAM runs out; a scheduler's hard limit or `kill -9` send it too.",
    "SIGTERM": "SIGTERM was not handled as an interrupt: a scheduler, a time limit or a parent process stopped it.",
    "SIGSEGV": "a crash in native code (a CUDA kernel, an extension, a driver)",
    "SIGBUS": "a crash in native code or shared memory (/dev/shm) exhausted",
    "SIGABRT": "a native abort (an assertion in C++ code, a CUDA device-side assert)",
}


def _killed_cause(run: RunDir) -> Cause:
    """A worker that died without writing status.json: the exit signal the runner recorded (runner.json)
    and the last phase it started (events.jsonl)."""
    last = last_step(run)
    step, phase = last_phase_started(run)
    rc = runner_record(run).get("returncode")
    sig = None
    if isinstance(rc, int) and rc < 0:
        try:
            sig = signal.Signals(-rc).name
        except ValueError:
            sig = f"signal {-rc}"
    where = f" in {phase} at step {step}" if phase else ""
    ev = [
        f"last complete metrics line: step {last}" if last is not None else "no metrics line was completed",
        f"{len(run.findings)} findings recorded before it died",
    ]
    if phase:
        ev.insert(0, f"last phase started: {phase} at step {step} (events.jsonl phase_start)")
    if rc is not None:
        ev.insert(0, f"exit code {rc} (runner.json)" + (f": killed by {sig}" if sig else ""))
    running = _running_in(run, phase)
    if running:
        ev.append(f"running in that phase: {running}")
    if sig:
        title = f"Killed by {sig}{where}" + (": likely the OOM killer (host RAM)" if sig == "SIGKILL" else "")
        what = f"The worker was killed by {sig}{where}. " + _SIGNAL_WHAT.get(sig, "")
    else:
        title = f"Killed without a status{where}" + (f" (exit code {rc})" if rc is not None else "")
        what = (
            "The process died without writing status.json: killed by the OS OOM killer (host RAM), a scheduler "
            "time limit, SIGKILL, or a crash in native code. Python exceptions, device OOM, NaN aborts and Ctrl-C "
            "are all recorded, so they are ruled out."
        )
    fixes = [
        Fix(
            None,
            None,
            "check `dmesg -T | grep -i 'killed process'`: an OOM-killer line names the process and "
            f"its memory; host RAM ran out{where}" + (f" while {running} ran" if running else ""),
        )
    ]
    fixes += _host_memory_fixes(run, phase)
    return Cause(
        "error",
        "killed",
        title,
        what,
        evidence=ev,
        fixes=fixes,
        step=step if step is not None else last,
        where=phase,
        score=40.0,
        phase=phase,
        seq=LAST,
        data={"signal": sig, "returncode": rc},
    )


def _running_in(run: RunDir, phase: str | None) -> str | None:
    """The user plug-in the trainer calls in ``phase`` (reward: the reward function or model)."""
    if phase == "reward":
        for key in ("model.reward_model", "data.reward_fn", "data.compute_score"):
            spec = cfg(run, *key.split("."))
            if spec:
                return f"{key} ({spec})"
    if phase == "rollout" and cfg(run, "data", "collator"):
        return f"data.collator ({cfg(run, 'data', 'collator')})"
    return None


def _host_memory_fixes(run: RunDir, phase: str | None) -> list[Fix]:
    """What lowers host memory in the phase that was running."""
    b, r = cfg(run, "algo", "batch_size"), cfg(run, "data", "response_length")
    if phase in ("rollout", "reward") and isinstance(b, int) and b > 1:
        return [
            Fix(f"algo.batch_size: {b // 2}", V.MAX_RESPONSE_LENGTH, "fewer sequences in host memory at once")
        ]
    if phase and phase.endswith("update"):
        mb = cfg(run, "algo", "micro_batch_size")
        if isinstance(mb, int) and mb > 1:
            return [Fix(f"algo.micro_batch_size: {mb // 2}", V.micro_batch("actor"), "smaller micro-batches")]
    if isinstance(r, int) and r > 1:
        return [Fix(f"data.response_length: {r // 2}", V.MAX_RESPONSE_LENGTH, "shorter sequences")]
    return []
