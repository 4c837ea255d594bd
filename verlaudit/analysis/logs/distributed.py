"""Distributed failures: NCCL and Gloo timeouts and watchdog aborts (torch ProcessGroupNCCL's
``Watchdog caught collective operation timeout: WorkNCCL(SeqNum=.., OpType=..)``, the watchdog's
status lines, Gloo's ``Timed out waiting ...ms for recv operation``, monitored barriers, the c10d
store at setup), NCCL errors, CUDA kernel faults the watchdog surfaces, processes killed by a signal
(torch elastic's ``failed (exitcode: -9) local_rank: N``, ``Signal 9 (SIGKILL)``, a shell's ``Killed``),
and Ray actor / worker deaths (read in `verlaudit.analysis.logs.deaths`). The first failing rank is named, and which rank the others waited for:
the one a monitored barrier or the store names, the one behind when ranks disagree on SeqNum.
Exercised by ``pytest tests/test_log_rules.py -k distributed``.
"""

from __future__ import annotations

import dataclasses
import re

from verlaudit.analysis.causes import Cause
from verlaudit.analysis.logs import deaths
from verlaudit.analysis.logs.frameworks import LogContext, advice, fixes
from verlaudit.analysis.logs.lines import LogLine, hints
from verlaudit.analysis.logs.scan import Hit, LogFacts, place, quote

_RULES = [
    ("nccl_timeout", re.compile(
        r"\[Rank (\d+)\] Watchdog caught collective operation timeout:\s*WorkNCCL\(SeqNum=(\d+),\s*OpType=(\w+)"
        r"(?:, NumelIn=(\d+))?(?:, NumelOut=(\d+))?(?:,\s*Timeout\(ms\)=(\d+))?")),
    ("nccl_status", re.compile(
        r"Rank (\d+)\]\s+(?:Exception \(either an error or timeout\) detected by watchdog at work: (\d+), "
        r"last enqueued NCCL work: (-?\d+), last completed NCCL work: (-?\d+)"
        r"|failure detected by watchdog at work sequence id: (\d+) PG status: last enqueued work: (-?\d+), "
        r"last completed work: (-?\d+))")),
    ("watchdog_error", re.compile(
        r"(?:Process group|NCCL) watchdog thread terminated with exception: "
        r"(?!\[Rank \d+\] Watchdog caught)(.+)")),
    # the rank whose watchdog fired first signals the others to dump (its own line may come after theirs)
    ("dump_from", re.compile(r"Received a dump signal due to a collective timeout from\s+rank (\d+)")),
    # Python logging's default format ("date time - INFO - accelerate.accelerator - Saving ..."): what a rank did last
    ("logged", re.compile(r"^[\d/:., -]+ - (?:INFO|WARNING|DEBUG) - ([A-Za-z_][\w.]*\.[\w.]+) - (.{4,160})$")),
    ("nccl_takedown", re.compile(
        r"\[Rank (\d+)\] To avoid data inconsistency, we are taking the entire process down")),
    ("gloo_timeout", re.compile(r"Timed out waiting (\d+)ms for (send|recv) operation to complete")),
    ("gloo_peer", re.compile(
        r"Connection closed by peer \[([^\]]+)\]|Application timeout caused pair closure")),
    ("barrier_from", re.compile(
        r"Rank (\d+) successfully reached monitoredBarrier, but received errors while waiting for send/recv "
        r"from rank (\d+)")),
    ("barrier_failed", re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier in (\d+) ms")),
    ("store_timeout", re.compile(
        r"\[(\d+)\] is setting up NCCL communicator and retrieving ncclUniqueId from \[(\d+)\] via c10d "
        r"key-value store by key '[^']*', but store->get\('[^']*'\) got error: "
        r"([\w ]+?)(?: after (\d+)ms)?[,.]")),
    ("store_clients", re.compile(
        r"Timed out after (\d+) seconds waiting for clients\. (\d+)/(\d+) clients joined")),
    ("heartbeat", re.compile(r"Heartbeat monitor timed out|watchdog got stuck for (\d+) seconds")),
    ("nccl_error", re.compile(
        r"NCCL error in: \S+, ([^,(\n]+)|\bDistNetworkError\b"
        r"|\bnccl(?:System|Internal|UnhandledCuda|Remote|InvalidUsage)Error\b"
        r"|NCCL communicator was aborted on rank (\d+)"
        # NCCL's own WARN that it cannot load a library it needs (the CUDA driver's libcuda.so): fatal, where
        # the same loader message on an INFO line is a probe (its network plugin) that falls back
        r"|NCCL WARN (Failed to find CUDA library [\w.]+|[^\n]*?cannot open shared object file)")),
    ("nccl_version", re.compile(r"^\s*NCCL version (\d+\.\d+\.\d+)")),
    ("nccl_shm", re.compile(
        r"Error while creating shared memory segment|Call to posix_fallocate failed|ncclShmOpen")),
    ("cuda_fault", re.compile(
        r"(?:CUDA error|Triton Error \[CUDA\]): (an illegal memory access was encountered"
        r"|an illegal instruction was encountered|device-side assert triggered|misaligned address"
        r"|unspecified launch failure)")),
    ("elastic_failed", re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")),
    ("launcher_exit", re.compile(
        r"sigkill_handler\] exits with return code = (-?\d+)|(?:exited with|exit) code (137)\b"
        r"|interrupted by signal (\d+): (SIG\w+)")),
    # torch elastic's Root Cause table, its fields on their own lines or (a paste that lost its line breaks)
    # run together: "rank2 (local rank: 2)exitcode: -9 (pid: 36071)error file: <N/A>"
    ("elastic_rank", re.compile(r"(?:^\s*|\b)rank\s*:?\s*(\d+) \(local[_ ]rank: (\d+)\)")),
    ("elastic_exit", re.compile(r"(?:^\s*|(?<=\))|\b)exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)")),
    ("signal", re.compile(
        r"[Ss]ignal (\d+) \((SIG\w+)\) received by PID (\d+)|died with <Signals\.(SIG\w+): (\d+)>")),
    ("sigterm_sent", re.compile(r"Sending process (\d+) closing signal (SIG\w+)")),
    # a launcher reporting a child that ended on a signal: MPI's "mpirun noticed that process rank 1 with PID
    # 77 on node n1 exited on signal 9 (Killed)", slurm's "srun: error: n1: task 3: Killed"
    ("launcher_signal", re.compile(
        r"(?:mpirun|mpiexec|prterun) noticed that process rank (\d+) with PID \d+ on node \S+ exited on signal "
        r"(\d+) \(([^)]+)\)|srun: error: \S+: tasks? ([\d,-]+): (Killed|Terminated|Segmentation fault|Aborted"
        r"|Out Of Memory)")),
    # DeepSpeed's launcher tearing its children down (sigkill_handler runs when a child ended non-zero or the
    # launcher itself got a signal): with no error of the child's own above it, the child was killed
    ("launcher_teardown", re.compile(r"sigkill_handler\] Killing subprocess (\d+)|^Killing subprocess (\d+)$")),
    ("launcher_interrupt", re.compile(r"Main process received (SIG\w+), exiting")),
    # a shell's "Killed", alone, after a script's line number, or after a progress bar (tqdm ends its line
    # without a newline, so the shell's word lands on it: "... 0/2 [00:00<?, ?it/s]Killed")
    ("shell_killed", re.compile(r"^(?:.*\bline \d+:\s+\d+\s+|.*\d+/\d+ \[[^\]]*\]\s*)?Killed(?:\s{2,}\S.*)?\s*$")),
    ("ray_task", re.compile(r"RayTaskError\((\w+)\): ray::([\w.]+)\(")),
    ("actor_died", re.compile(r"ActorDiedError: |The actor died unexpectedly before finishing this task")),
    ("worker_died", re.compile(
        r"A worker died or was killed while executing a task by an unexpected system error"
        r"|The actor is dead because its worker process has died")),
    # a native crash's own report: abseil's "PC: @ 0x7f17f832d44a  (unknown)  addProxyOpIfNeeded()" (the
    # faulting native function) and faulthandler's Python stack under "Fatal Python error: Segmentation fault"
    ("native_pc", re.compile(r"\bPC: @\s+0x[0-9a-f]+\s+\S+\s+([A-Za-z_][\w:~<>]*)\(")),
    ("faulthandler", re.compile(r"Fatal Python error: (Segmentation fault|Aborted|Bus error|Floating point "
                                r"exception|Illegal instruction)")),
    # NCCL refusing two ranks of one communicator on one GPU (its init check): the ranks' GPU placement
    ("nccl_duplicate_gpu", re.compile(r"Duplicate GPU detected\s*:\s*rank (\d+) and rank (\d+) both on CUDA device "
                                      r"(\w+)")),
    ("worker_exit", re.compile(r"Worker exit type: (\w+),? Worker exit detail: ([^.]+\.?)")),
]  # fmt: skip
_KEYS = (
    "NCCL", "Watchdog", "watchdog", "gloo", "Timed out", "monitoredBarrier", "exitcode", "Signal", "SIG",
    "Killed", "137", "return code", "signal", "Ray", "ray::", "actor", "worker", "CUDA error", "Triton Error",
    "clients", "Heartbeat", "nccl", "rank", "noticed that process", "srun: error", "subprocess",
    "Main process received", "PC: @", "Fatal Python", " - INFO - ", " - WARNING - ", " - DEBUG - ",
)  # fmt: skip


_HAS = hints(*_KEYS)


def detect(line: LogLine) -> list[Hit]:
    """Distributed-failure messages in one line."""
    text = line.text
    if not _HAS(text):
        return []
    out = []
    for rule, pat in _RULES:
        m = pat.search(text)
        if m:
            want = 8 if rule == "actor_died" else 4 if rule == "faulthandler" else 0
            out.append(Hit(rule, line, {"groups": m.groups()}, want=want))
    if any(
        h.rule == "nccl_timeout" for h in out
    ):  # "terminated with exception: [Rank 1] Watchdog caught" twice
        out = [h for h in out if h.rule != "watchdog_error"]
    elif _CUT.search(text):  # the watchdog's line cut by a paste's hard wrap: rejoined in `_rejoined`
        out.append(Hit("nccl_timeout_cut", line, {}, want=2))
    return out


_TIMEOUT = _RULES[0][1]
_CUT = re.compile(r"\[Rank \d+\] Watchdog caught collective operation timeout")


def _rejoined(facts: LogFacts) -> LogFacts:
    """The facts with each watchdog timeout a hard-wrapped paste cut over lines read from the line and the
    lines after it rejoined (with nothing between them, as a terminal's wrap cuts, else a space)."""
    found = []
    for h in facts.of("nccl_timeout_cut"):
        m = _TIMEOUT.search(h.text("")) or _TIMEOUT.search(h.text(" "))
        if m:
            found.append(Hit("nccl_timeout", h.line, {"groups": m.groups()}))
    if not found:
        return facts
    hits = {**facts.hits, "nccl_timeout": sorted([*facts.of("nccl_timeout"), *found], key=lambda h: h.no)}
    counts = {**facts.counts, "nccl_timeout": facts.count("nccl_timeout") + len(found)}
    return dataclasses.replace(facts, hits=hits, counts=counts)


def explain(facts: LogFacts, ctx: LogContext) -> list[Cause]:
    """Collective timeouts, NCCL errors, CUDA faults, kills and Ray actor deaths."""
    facts = _rejoined(facts)
    causes = [
        _collective(facts, ctx),
        _duplicate_gpu(facts, ctx) or _nccl_error(facts, ctx),
        _cuda_fault(facts, ctx),
        deaths.killed(facts, ctx),
        deaths.ray_died(facts, ctx),
    ]
    return [c for c in causes if c]


EARLY_SEQ = 8
"""A collective this early in a process group's sequence (setup barriers and parameter broadcasts) is
taken as start-up."""


@dataclasses.dataclass
class _Wait:
    """What the collective-failure messages say: who waited, for which rank, in what, since when."""

    title: str = ""
    culprit: int | None = None
    evidence: list[str] = dataclasses.field(default_factory=list)
    at_init: bool = False
    """No collective ever completed (SeqNum 1, or the watchdog's last completed work is -1)."""
    early: bool = False
    """One of a process group's first few collectives: the job was still starting up."""
    gradient: bool = False
    """A reduce-scatter: FSDP / ZeRO reduce gradients that way, so the update's backward."""
    diverged: bool = False


def _watchdog(facts: LogFacts, w: _Wait) -> None:
    """NCCL watchdog timeouts: the first failing rank, or the rank behind when the ranks disagree on
    the collective's SeqNum (the others moved on); whether any collective ever completed."""
    seq_of: dict[int, int] = {}
    for h in facts.of("nccl_timeout"):
        seq_of.setdefault(int(h.fields["groups"][0]), int(h.fields["groups"][1]))
    order = list(seq_of)
    first = facts.first("nccl_timeout")
    if first is not None:
        _, seq, op, numel, _, tmo = first.fields["groups"]
        w.culprit = order[0]
        if len(set(seq_of.values())) > 1:
            lag = min(seq_of.values())
            behind = [r for r in order if seq_of[r] == lag]
            w.culprit, w.diverged = behind[0], True
            ahead = ", ".join(f"rank {r} at {s}" for r, s in seq_of.items() if s != lag)
            w.evidence.append(
                f"ranks disagree on the collective: rank(s) {', '.join(map(str, behind))} at SeqNum "
                f"{lag}, {ahead}: the ranks went out of step"
            )
        w.at_init = int(seq) <= 1
        w.early = int(seq) <= EARLY_SEQ
        w.gradient = "REDUCE_SCATTER" in op
        waited = f" waited {int(tmo) / 1000:.0f} s" if tmo else " timed out"
        size = f", {int(numel):,} elements" if numel else ""
        w.title = f"NCCL collective timeout: rank {w.culprit}{waited} in {op} (SeqNum {seq}{size})"
        w.evidence.append(quote(first.line, 400))
        reported = set(order) | {int(h.fields["groups"][0]) for h in facts.of("nccl_takedown")}
        silent = sorted(set(range(max(reported) + 1)) - reported)
        if len(order) >= 3 and len(silent) == 1 and not w.diverged:
            # every other rank waits in the same collective and one never timed out: it is elsewhere (saving,
            # a long eval, its own hang), the rank they all wait for
            w.culprit = silent[0]
            w.title = (
                f"NCCL collective timeout: ranks {', '.join(map(str, sorted(order)))}{waited} in {op} (SeqNum "
                f"{seq}{size}); rank {silent[0]} printed no timeout: likely the one they waited for"
            )
        if len(order) >= 3 and silent:  # every other rank reported: the silent ones may be the stuck ones
            w.evidence.append(
                f"no timeout printed by rank(s) {', '.join(map(str, silent[:16]))} (of 0-{max(reported)}): "
                "if their output is in this log, look there for the first failure"
            )
        dump = facts.first("dump_from")
        if dump and not w.diverged and w.culprit == order[0] and int(dump.fields["groups"][0]) != w.culprit:
            w.culprit = int(
                dump.fields["groups"][0]
            )  # the first to time out, whatever order the lines came in
            w.title = w.title.replace(f"rank {order[0]} ", f"rank {w.culprit} (the first to time out) ", 1)
            w.evidence.append(f"{quote(dump.line, 200)}: rank {w.culprit} timed out first")
        if len(order) > 1:
            w.evidence.append(
                f"{len(order)} ranks timed out ({', '.join(map(str, order[:16]))}); rank {order[0]} "
                "first in the log"
            )
    for h in facts.of("nccl_status")[:2]:
        g = h.fields["groups"]
        done = g[3] if g[3] is not None else g[6]
        w.at_init |= done is not None and int(done) < 0  # last completed work -1: none ever completed
        w.evidence.append(quote(h.line, 240))


def _named_waits(facts: LogFacts, w: _Wait) -> None:
    """The messages that name the rank the others waited for: a monitored barrier, the c10d store at
    setup (rank 0 publishes the NCCL id), a Gloo send / recv, a stuck heartbeat."""
    barrier = facts.first("barrier_from")
    if barrier:
        waiter, w.culprit = (int(x) for x in barrier.fields["groups"])
        w.title = w.title or f"Gloo timeout: rank {waiter} waited for send/recv from rank {w.culprit}"
        w.evidence.append(quote(barrier.line))
    failed = facts.first("barrier_failed")
    if failed:
        ranks = re.findall(r"\d+", failed.fields["groups"][0])
        w.culprit = int(ranks[0]) if ranks else w.culprit
        w.title = w.title or f"Monitored barrier: rank(s) {', '.join(ranks)} never arrived"
        w.evidence.append(quote(failed.line))
    store = facts.first("store_timeout", "store_clients")
    if store:
        g, w.at_init = store.fields["groups"], True
        if store.rule == "store_timeout":
            w.culprit = int(g[1])
            took = f" {int(g[3]) / 1000:.0f} s" if g[3] else ""
            w.title = (
                w.title
                or f"Process-group setup timed out: rank {g[0]} waited{took} for rank {g[1]}'s NCCL id"
            )
        else:
            w.title = w.title or f"Rendezvous timed out after {g[0]} s: {g[1]} of {g[2]} processes joined"
        w.evidence.append(quote(store.line))
    gloo = facts.first("gloo_timeout")
    if gloo:
        g = gloo.fields["groups"]
        w.culprit = w.culprit if w.culprit is not None else gloo.line.rank
        on = f" on rank {w.culprit}" if w.culprit is not None else ""
        w.title = w.title or f"Gloo timeout: {g[1]} waited {int(g[0]) / 1000:.0f} s{on}"
        w.evidence.append(quote(gloo.line))
    beat = facts.first("heartbeat")
    if beat and not w.title:
        w.title = "NCCL heartbeat monitor: a watchdog got stuck (a hung collective or CUDA call)"
        w.evidence.append(quote(beat.line))


_COLLECTIVE_WHAT = (
    "A collective did not complete on every rank within the timeout, so the watchdog aborted it and took the "
    "process down. The timeout is a symptom: one rank never joined, because it died, hung or took another "
    "code path. Look for that rank's own error earlier in the log (an OOM, an exception, a kill)."
)


def _collective_fixes(ctx: LogContext, w: _Wait, phase: str | None) -> list:
    return fixes(
        ctx,
        advice(
            "check that every node can reach the others: NCCL_DEBUG=INFO shows the transport; point "
            "NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME at an interface all nodes share"
        )
        if w.at_init
        else None,
        advice(
            "make every rank issue the same collectives: equal batch counts per rank (drop_last, the same "
            "number of micro-batches under dynamic batch sizes), no rank-dependent early exit"
        )
        if w.diverged
        else None,
        (
            "collective_timeout",
            "raise it when one rank legitimately works alone that long (checkpoint save, evaluation)",
        )
        if phase == "checkpoint"
        else None,
        advice(
            "find the stuck rank's own error above the timeout, or take a py-spy dump of it while it hangs"
        ),
        advice(
            "set TORCH_NCCL_TRACE_BUFFER_SIZE=2000 and TORCH_NCCL_DUMP_ON_TIMEOUT=1: the flight recorder "
            "dumps each rank's last collectives and their Python stacks"
        ),
        None
        if w.at_init
        else advice(
            "if a value computed on one rank decides whether the ranks enter a collective (a metric reduced with "
            "dist.reduce, which leaves the result on the destination rank only; a rank-0-only save, evaluation or "
            "early stop): compute it with dist.all_reduce or broadcast it, so every rank takes the same path"
        ),
        ("collective_timeout", "raise it only when one rank legitimately works alone that long"),
    )


def _collective(facts: LogFacts, ctx: LogContext) -> Cause | None:
    first = facts.first(
        "nccl_timeout",
        "gloo_timeout",
        "barrier_from",
        "barrier_failed",
        "store_timeout",
        "store_clients",
        "heartbeat",
    )
    if first is None:
        return None
    w = _Wait()
    _watchdog(facts, w)
    _named_waits(facts, w)
    downs = sorted({int(h.fields["groups"][0]) for h in facts.of("nccl_takedown")})
    if downs:
        w.evidence.append(f"the watchdog took down rank(s) {', '.join(map(str, downs[:16]))} (the cascade)")
    pl = place(facts, first.line)
    phase = "init" if w.at_init or (w.early and pl.phase is None) else pl.phase
    if phase is None and w.gradient:
        phase, pl.phase_why = "update", "a gradient reduce-scatter"
    if w.early and not w.at_init and phase == "init":
        w.title += " at start-up"
        w.evidence.append(
            f"SeqNum {EARLY_SEQ} or less: one of the process group's first collectives, at start-up"
        )
    if w.at_init:
        w.title += (
            ""
            if "setup" in w.title or "Rendezvous" in w.title
            else " at start-up (no collective ever completed)"
        )
    elif phase and pl.phase_why:
        w.title += f" during {phase if pl.phase_why.startswith('activity') else pl.phase_why}"
    what = _COLLECTIVE_WHAT
    if w.at_init:
        what += (
            " Here no collective ever completed: the ranks could not reach each other (network interface, "
            "firewall, a rank that never started)."
        )
    if w.diverged:
        what += (
            " The ranks were in different collectives: a data-dependent branch or unequal numbers of batches "
            "per rank made them issue different collective sequences."
        )
    fx = _collective_fixes(ctx, w, phase)
    last = [h for h in facts.of("logged") if 0 < first.no - h.no <= 60]
    if (
        last and pl.tb is None
    ):  # no stack: the logger of the last line before the hang says what the job was doing
        w.evidence.append(f"last logged before the timeout: {quote(last[-1].line, 200)}")
    return Cause(
        "error",
        "nccl_timeout",
        w.title,
        what,
        evidence=w.evidence + pl.evidence(),
        fixes=fx,
        where=(f"rank {w.culprit}" if w.culprit is not None else pl.culprit(frame=False) or "")
        + (
            f" (last logged by {last[-1].fields['groups'][0]}: {last[-1].fields['groups'][1][:60]})"
            if last and pl.tb is None
            else ""
        )
        or None,
        phase=phase,
        rank=w.culprit,
        line=first.no,
        score=38.0,
        unknown=["why the missing rank stalled, unless its own error is in this log"],
    )


def _duplicate_gpu(facts: LogFacts, ctx: LogContext) -> Cause | None:
    """NCCL's "Duplicate GPU detected : rank a and rank b both on CUDA device d" (logsg branch): not a failure of
    NCCL or of the network but of the placement of the ranks on GPUs: two ranks of one communicator were given one
    device (each process's visible devices, its local rank -> device mapping, or the scheduler placing them)."""
    h = facts.first("nccl_duplicate_gpu")
    if h is None:
        return None
    a, b, dev = h.fields["groups"]
    pl = place(facts, h.line)
    ray = ctx.framework in ("verl", "openrlhf", "nemo-rl", "ray") or ctx.shows("ray")
    return Cause(
        "error",
        "exception",
        f"Two ranks on one GPU: rank {a} and rank {b} both on CUDA device {dev}; NCCL refuses the communicator",
        "NCCL builds a communicator over one GPU per rank and refuses two ranks on one device. The ranks were "
        "placed wrongly: each process set the same device (a fixed cuda:N or torch.cuda.set_device of the global "
        "rank on a node with fewer GPUs), its CUDA_VISIBLE_DEVICES shows the same GPU to both, or the scheduler "
        "that starts the workers (Ray's GPU assignment, srun's binding) gave both the same GPU.",
        evidence=[quote(h.line)] + pl.evidence(),
        fixes=fixes(
            ctx,
            advice(
                "give each rank its own device: torch.cuda.set_device(local_rank) (not the global rank), and "
                "check CUDA_VISIBLE_DEVICES as each process sees it (print it with the rank)"
            ),
            advice(
                "the workers are Ray actors: Ray sets each actor's CUDA_VISIBLE_DEVICES from its num_gpus; "
                "check the placement (ray status) and the ray release the framework pins (pip install "
                "--upgrade ray where an old Ray mis-assigns GPUs)"
            )
            if ray
            else None,
        ),  # fmt: skip
        where=f"rank {a} and rank {b} on CUDA device {dev}" + (" (placed by Ray)" if ray else ""),
        phase=pl.phase or "init",
        rank=int(a),
        line=h.no,
        score=38.0,
    )


def _nccl_error(facts: LogFacts, ctx: LogContext) -> Cause | None:
    h = facts.first("nccl_error")
    if h is None or facts.count("nccl_timeout", "gloo_timeout"):
        return None
    pl = place(facts, h.line)
    g = h.fields["groups"]
    detail = (g[0] or g[2] or "").strip()
    version = facts.first("nccl_version")
    nccl = f"NCCL {version.fields['groups'][0]}" if version else None
    shm = facts.first("nccl_shm")
    what = (
        "A collective failed inside NCCL (not a timeout): a peer process exited, the network or the GPU "
        "interconnect failed, or the ranks passed inconsistent tensors."
    )
    if shm:
        what += (
            " Here NCCL could not create its shared-memory segment: /dev/shm is too small (a container's "
            "default is 64 MB) or full."
        )
    lib = g[2] is not None
    if lib:
        what = (
            f"{nccl or 'NCCL'} could not load a library it needs ({detail}), so no communicator can start: the "
            "CUDA driver library is not where this NCCL looks (a container or WSL without the driver mounted, "
            "an LD_LIBRARY_PATH that hides it), or this NCCL release has a bug locating it."
        )
    fx = fixes(
        ctx,
        advice(
            "give the container a larger /dev/shm (docker run --shm-size=16g, or --ipc=host; a Memory-backed "
            "emptyDir on Kubernetes), or set NCCL_SHM_DISABLE=1"
        )
        if shm
        else None,
        advice(
            "make libcuda.so findable (NCCL_CUDA_PATH, LD_LIBRARY_PATH with the driver's directory; WSL: "
            "/usr/lib/wsl/lib), or install another NCCL release (pip install -U nvidia-nccl-cu12"
            + (f"; {nccl} is the one that failed" if nccl else "")
            + ")"
        )
        if lib
        else None,
        advice("rerun with NCCL_DEBUG=INFO (NCCL_DEBUG_SUBSYS=INIT,NET) for NCCL's own reason"),
        advice("if a peer died first, its own error above is the root") if not lib else None,
    )
    ev = ([quote(shm.line)] if shm else []) + [quote(h.line)] + pl.evidence()
    return Cause(
        "error",
        "nccl_error",
        f"NCCL error{': ' + detail if detail else ''}",
        what,
        evidence=ev,
        fixes=fx,
        where="/dev/shm"
        if shm
        else f"{nccl or 'NCCL'} ({detail.split()[-1]})"
        if lib
        else pl.culprit(frame=False),
        phase=pl.phase,
        rank=pl.rank,
        line=h.no,
        score=36.0,
    )


def _cuda_fault(facts: LogFacts, ctx: LogContext) -> Cause | None:
    hits = facts.of("cuda_fault", "watchdog_error")
    hits = [h for h in hits if h.rule == "cuda_fault" or "CUDA" in h.line.text]
    if not hits:
        return None
    h = hits[0]
    pl = place(facts, h.line)
    m = re.search(
        r"(an illegal [\w ]+? was encountered|device-side assert triggered|misaligned address|unspecified "
        r"launch failure)",
        h.line.text,
    )
    engine = bool(
        re.search(
            r"sglang|vllm|Scheduler|EngineCore",
            " ".join(x.line.text for x in facts.of("engine_error")) + (h.line.source or ""),
        )
    )
    # where it surfaced (not the faulting kernel): the frame the fault's error was raised in (logsg branch)
    at = pl.tb.culprit() if pl.tb else None
    surfaced = f"surfaced in {at}" if at else None
    return Cause(
        "error",
        "cuda_error",
        f"CUDA kernel fault: {m[1] if m else 'CUDA error'}",
        "A CUDA kernel faulted; the error surfaces at a later CUDA call (often the NCCL watchdog's), so the "
        "reported place is not the faulting kernel. The ranks that time out afterwards are the cascade.",
        evidence=[quote(h.line)] + pl.evidence(),
        fixes=fixes(
            ctx,
            advice(
                "rerun with CUDA_LAUNCH_BLOCKING=1 (and TORCH_USE_CUDA_DSA for asserts) to stop "
                "at the faulting kernel"
            ),
            advice(
                "in an inference engine: disable CUDA graphs (enforce_eager) and the engine's "
                "fused / custom kernels, or move to the engine version the framework pins"
            )
            if engine
            else None,
            advice(
                "a device-side assert is usually an index out of range (token ids >= vocab size, "
                "labels, embedding lookups)"
            )
            if m and "assert" in m[1]
            else None,
        ),
        where=" / ".join(x for x in (pl.culprit(frame=False), surfaced) if x) or None,
        phase=pl.phase,
        rank=pl.rank,
        line=h.no,
        score=39.0,
    )
