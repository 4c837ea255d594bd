"""Processes that died: killed by a signal (torch elastic's ``failed (exitcode: -9) local_rank: N``,
``Signal 9 (SIGKILL)``, a shell's ``Killed``, srun's signals), native crashes of a worker, and Ray actor /
worker deaths: the dead process, its rank and what it was doing. The line patterns are matched in
`verlaudit.analysis.logs.distributed`, whose `explain` calls `killed` and `ray_died`. Exercised by
``pytest tests/test_log_rules.py -k distributed``.
"""

from __future__ import annotations

import re

from verlaudit.analysis.causes import Cause
from verlaudit.analysis.logs.frameworks import LogContext, advice, fixes
from verlaudit.analysis.logs.lines import LogLine
from verlaudit.analysis.logs.scan import Hit, LogFacts, place, quote


def _signal(facts: LogFacts) -> tuple[Hit, str | None, int | None, str | None] | None:
    """(the first kill line, the signal, torch elastic's exit code, the rank it names) of a killed process."""
    failed = [h for h in facts.of("elastic_failed") if int(h.fields["groups"][0]) < 0]
    table = [h for h in facts.of("elastic_exit") if int(h.fields["groups"][0]) < 0]
    for h in facts.of("launcher_exit"):  # DeepSpeed's launcher, a shell's 137 (128 + 9), an IDE's "signal 9"
        code, c137, num, _ = h.fields["groups"]
        value = int(code) if code else -9 if c137 else -int(num)
        if value < 0:
            table.append(Hit("launcher_exit", h.line, {"groups": (str(value), None)}))
    for h in facts.of(
        "launcher_signal"
    ):  # mpirun's "process rank N ... exited on signal S", srun's "task N: Killed"
        rank, num, _, tasks, word = h.fields["groups"]
        value = -int(num) if num else _SRUN_SIGNAL.get(word or "", -9)
        failed.append(
            Hit("launcher_signal", h.line, {"groups": (str(value), rank or (tasks or "").split(",")[0])})
        )
    sig = facts.of("signal", "shell_killed")
    raised = any(kind == "exception" for kind, _ in facts.signals)  # a child's own error explains a teardown
    teardown = [] if (failed or table or sig or raised) else facts.of("launcher_teardown")
    # torch elastic's agent terminating its workers ("Sending process N closing signal SIGTERM") with no
    # worker's error in the log: the agent itself was stopped (a scheduler's preemption or time limit, a
    # Ctrl-C, a sibling agent's failure); a signal line is never a healthy run's
    # (a worker the agent reports exiting on its own, `failed (exitcode: 1)`, is the failure the SIGTERMs follow)
    exited = facts.of("elastic_failed", "elastic_exit")
    terminated = [] if (failed or table or sig or raised or teardown or exited) else facts.of("sigterm_sent")
    if terminated:
        return terminated[0], terminated[0].fields["groups"][1], None, None
    if not (failed or table or sig or teardown):
        return None
    first = (failed or table or sig or teardown)[0]
    code = int(first.fields["groups"][0]) if failed or table else None
    where = None
    if (
        teardown
    ):  # DeepSpeed's launcher killing its children: the signal it got, or a child that died silently
        stop = facts.first("launcher_interrupt")
        return first, stop.fields["groups"][0] if stop else None, None, _only_rank(facts)
    if failed:
        where = f"{'rank' if first.rule == 'launcher_signal' else 'local_rank'} {first.fields['groups'][1]}"
    elif table:  # torch elastic's "Root Cause" table: the rank line sits a few lines above the exit code
        rank_line = next((h for h in facts.of("elastic_rank") if 0 <= first.no - h.no <= 6), None)
        where = f"rank {rank_line.fields['groups'][0]}" if rank_line else None
    signame = {-9: "SIGKILL", -15: "SIGTERM", -6: "SIGABRT", -11: "SIGSEGV", -7: "SIGBUS"}.get(code or 0)
    if sig and not signame:
        g = sig[0].fields["groups"]
        signame = "SIGKILL" if sig[0].rule == "shell_killed" else (g[1] or g[3])
    return first, signame, code, where


_SRUN_SIGNAL = {
    "Killed": -9,
    "Terminated": -15,
    "Segmentation fault": -11,
    "Aborted": -6,
    "Out Of Memory": -9,
}


def _only_rank(facts: LogFacts) -> str | None:
    """``local_rank 0`` when the launcher's printed world has one process (DeepSpeed's ``dist_world_size=1``,
    torchrun's ``--nproc_per_node 1`` on one node): the only child it can have killed."""
    world = facts.settings.get("dist_world_size") or facts.settings.get("world_size")
    procs, nodes = (
        facts.settings.get("num_local_procs") or facts.settings.get("nproc_per_node"),
        facts.settings.get("nnodes"),
    )
    return "local_rank 0" if world == "1" or (procs == "1" and nodes in (None, "1")) else None


def _kill_reading(signame: str | None, silent: bool, phase: str | None, ctx: LogContext) -> tuple[str, list]:
    """(what happened, the fixes) of a kill: a SIGKILL or a launcher's teardown after a silent child (the
    OOM killer first), another signal (who sent it)."""
    if signame == "SIGKILL" or silent:
        what = (
            "The process was killed with SIGKILL and printed no Python error of its own. The usual sender "
            "is the "
            "kernel's OOM killer (host RAM), then a scheduler's memory limit (slurm, Kubernetes) or a "
            "manual kill."
        )
        if silent:
            what = (
                "The launcher killed its subprocesses: it does so when a child ends with a non-zero status, and "
                "this child printed no Python error of its own first, so it was most likely killed by a signal. "
                "The usual sender of a silent kill is the kernel's OOM killer (host RAM), then a scheduler's "
                "memory limit (slurm, Kubernetes) or a manual kill."
            )
        fx = fixes(
            ctx,
            advice(
                "check `dmesg -T | grep -i -E 'killed process|oom'` on the node, or the scheduler's "
                "record of the job, to confirm who killed it"
            ),
            advice(
                "loading: each process materialises the full checkpoint in host RAM; load once per node or "
                "shard at load time (low_cpu_mem_usage, meta-device init, ZeRO-3 init)"
            )
            if phase == "init"
            else None,
            ("zero3", "shards the model at load time") if phase == "init" else None,
            advice("give the node more RAM or run fewer processes per node"),
        )
    else:
        what = f"The process ended on {signame or 'a signal'} with no Python error of its own."
        fx = fixes(
            ctx,
            advice(
                "find who sent the signal: the scheduler (preemption, time limit), the launcher (after "
                "another rank failed) or a crash (SIGSEGV / SIGABRT: a native library)"
            ),
        )
    return what, fx


def killed(facts: LogFacts, ctx: LogContext) -> Cause | None:
    found = _signal(facts)
    if found is None:
        return None
    first, signame, code, where = found
    # a kill that landed on a progress bar names what was running (tqdm's description before the bar);
    # "Loading checkpoint shards" is transformers' from_pretrained
    bar = re.match(r"^\s*([A-Za-z][\w .-]*?):\s*\d+%\|", first.line.text)
    if bar and not where:
        where = f"{'from_pretrained: ' if bar[1] == 'Loading checkpoint shards' else 'while: '}{bar[1]}"
    cascade = sorted({h.fields["groups"][0] for h in facts.of("sigterm_sent")})
    pl = place(facts, first.line)
    ev = [quote(first.line)]
    if first.rule == "sigterm_sent":
        ev.append(
            f"the launcher's agent sent {signame} to {len(cascade)} worker process(es) and no worker printed an "
            "error of its own: the agent was told to stop"
        )
    elif cascade:
        ev.append(
            f"the launcher then sent SIGTERM to {len(cascade)} other process(es) (the cascade, not the cause)"
        )
    ev += pl.evidence()
    silent = first.rule == "launcher_teardown" and signame is None
    what, fx = _kill_reading(signame, silent, pl.phase, ctx)
    title = (
        (
            "Process killed: the launcher tore down its subprocesses after a silent exit"
            if silent
            else f"Process killed by {signame or 'a signal'}"
        )
        + (f" ({where})" if where else "")
        + (f" during {pl.phase}" if pl.phase else "")
    )
    return Cause(
        "error",
        "killed",
        title,
        what,
        evidence=ev,
        fixes=fx,
        where=where or pl.culprit(frame=False),
        phase=pl.phase,
        rank=pl.rank,
        line=first.no,
        score=35.0,
        data={"signal": signame, "exitcode": code},
        unknown=["who sent the signal: a log cannot show it (the kernel log or the scheduler can)"],
    )


def _native_crash(facts: LogFacts, near: int | None) -> tuple[str, str, LogLine] | None:
    """(the Ray process, the signal, the line) of a native crash a Ray worker printed itself (abseil's
    ``*** SIGSEGV received at ...``, faulthandler's ``Fatal Python error: Segmentation fault``) within a few
    dozen lines of an actor's death: the worker that died, and how."""
    for kind, line in facts.signals:
        if (
            kind != "kill"
            or not line.source
            or line.source in ("raylet", "gcs_server")
            or (near is not None and abs(line.no - near) > 40)
        ):
            continue
        m = re.search(r"\*\*\* (SIG[A-Z]+) received|Fatal Python error: ([\w ]+)", line.text)
        if m:
            return line.source, m[1] or m[2].strip(), line
    return None


def _crashed_frame(facts: LogFacts, source: str) -> str | None:
    """``module.func (native function)`` of a native crash in ``source``: faulthandler's innermost Python
    frame (``File ".../pynccl_wrapper.py", line 257 in ncclAllReduce``) and abseil's faulting PC."""
    dump = next((" ".join(h.follow) for h in facts.of("faulthandler") if h.line.source == source), "")
    m = re.search(r'File "(?:[^"]*/)?([\w.]+?)(?:\.py)?", line \d+ in (\w+)', dump)
    py = f"{m[1]}.{m[2]}" if m else None
    pc = next((h.fields["groups"][0] for h in facts.of("native_pc") if h.line.source == source), None)
    return " ".join(p for p in (py, f"({pc})" if pc else None) if p) or None


def _crashed_worker(facts: LogFacts, ctx: LogContext, crash: tuple[str, str, LogLine]) -> Cause:
    source, sig, line = crash
    at = _crashed_frame(facts, source)
    pl = place(facts, line)
    return Cause(
        "error",
        "ray_actor_died",
        f"Ray worker {source} crashed with {sig}" + (f" in {at}" if at else ""),
        "A Ray worker process crashed in native code (a library's C++ / CUDA code: NCCL, a CUDA kernel, a "
        "compiled extension, Ray's core) and died with it; every call waiting on the actor fails next with "
        "ActorDiedError. Not the OOM killer: a kill prints no signal report of its own.",
        evidence=[quote(line)] + pl.evidence(),
        fixes=[
            advice(
                "the faulting function names the library: match its version to the one the framework "
                "pins (NCCL / torch / the engine); for NCCL, NCCL_DEBUG=INFO shows the transport it used"
            )
        ],
        where=f"{source}: {at}" if at else source,
        phase=pl.phase,
        rank=pl.rank,
        line=line.no,
        score=33.0,
        unknown=["why the native code crashed: a core dump or the library's own debug log tells"],
    )


def _dead_actor(facts: LogFacts) -> dict[str, str]:
    """The fields ActorDiedError prints under itself (class_name, name, pid, actor_id, ip)."""
    fields: dict[str, str] = {}
    for h in facts.of("actor_died"):
        for t in h.follow:
            m = re.match(r"\s*(class_name|name|pid|actor_id|ip): (\S+)", t)
            if m:
                fields.setdefault(m[1], m[2])
    return fields


# long: one reading of a dead actor: its fields, the task, the native crash and the phase, then one cause
def ray_died(facts: LogFacts, ctx: LogContext) -> Cause | None:
    died = facts.of("actor_died", "worker_died")
    tasks = [
        h
        for h in facts.of("ray_task")
        if h.fields["groups"][0] in ("ActorDiedError", "RaySystemError", "WorkerCrashedError")
    ]
    alone = None if (died or tasks) else _native_crash(facts, None)
    if not (died or tasks or alone):
        return None
    if alone:  # a Ray worker's own native-crash report, the paste cut before the death its callers see
        return _crashed_worker(facts, ctx, alone)
    first = (died or tasks)[0]
    fields = _dead_actor(facts)
    name = re.sub(r"^[A-Za-z0-9]{6}(?=\w+_\d+:\d+$)", "", fields.get("name", ""))  # verl's random name prefix
    exit_ = facts.first("worker_exit")
    task = tasks[0].fields["groups"][1] if tasks else None
    pl = place(facts, first.line)
    crash = _native_crash(facts, first.no)
    cls = fields.get("class_name")  # the dead actor's class names its role (CriticModelRayActor, WorkerDict)
    shown = name or fields.get("name")
    where_parts = [
        task,
        shown,
        cls if cls and cls not in (shown or "") and cls not in (task or "") else None,
        f"pid {fields['pid']}" if "pid" in fields else None,
    ]
    where = (
        " / ".join(p for p in where_parts if p)
        or (f"{crash[0]} ({crash[1]})" if crash else None)
        or pl.culprit(frame=False)
    )
    ev = [quote(first.line)] + ([quote(exit_.line, 240)] if exit_ else []) + pl.evidence()
    if name:
        cls, pid = fields.get("class_name", "?"), fields.get("pid", "?")
        ev.append(f"dead actor: {fields.get('name')} ({cls}, pid {pid})")
    detail = exit_.fields["groups"][1] if exit_ else ""
    eof = "connection error" in detail or "End of file" in detail
    what = (
        "A Ray actor's worker process died, so every call waiting on it failed with ActorDiedError; that "
        "error is "
        "the cascade. The worker itself printed no error here"
        + (
            "; an EOF on its connection means it was killed (SIGKILL: usually the OOM killer) or crashed."
            if eof
            else "."
        )
    )
    if crash:
        what += (
            f" Its process ({crash[0]}) reported a native crash ({crash[1]}) of its own: a crash in native code "
            "(a library's C++ / CUDA code, a Ray core bug), not the OOM killer."
        )
        ev.append(quote(crash[2]))
    during = pl.phase if not pl.phase_why or pl.phase_why.startswith("activity") else pl.phase_why
    title = "Ray actor died" + (
        f": {name or fields['name']}" if fields.get("name") else f": {cls}" if cls else ""
    )
    if crash and not fields.get("name"):
        title += f": {crash[0]} crashed with {crash[1]}"
    title += f" during {during}" if pl.phase else ""
    fx = fixes(
        ctx,
        advice(
            "read the dead worker's own log (`ray logs worker-<id>*out` on its node) and `dmesg -T | grep -i "
            "killed` for the OOM killer"
        ),
        ("token_budget", "smaller per-GPU token budgets lower both GPU and host memory per worker"),
        ("rollout_memory", "lower if the worker died in generation next to a resident trainer")
        if pl.phase in ("generate", "weight_sync", None)
        else None,
        advice("if host RAM: fewer workers per node, or more RAM"),
    )
    return Cause(
        "error",
        "ray_actor_died",
        title,
        what,
        evidence=ev,
        fixes=fx,
        where=where,
        phase=pl.phase,
        rank=pl.rank,
        line=first.no,
        score=33.0,
        unknown=["why the worker died: its own log and the kernel log tell, this log does not"],
    )
