"""An out-of-memory run, explained with the planner: what filled the GPU, and only the fixes the
planner says would make the step fit.

`oom_cause(run)` reads status.json's allocator view and re-plans the run at the failing phase
(`verlaudit.analysis.diagnose.failure.memory_at_failure`, narrowed to the forward the traceback shows). Each fix
that is a config change is re-planned with the change; it is offered only when the planned need fits
what the process could use: the emulation cap, which caps the caching allocator alone (the CUDA
context lives outside it), or the device's memory. When no single change fits, the smallest set of
changes that does is offered instead. Sizes are printed with the precision they have (a 0.45 GiB cap
is 0.45). Exercised by `pytest tests/test_diagnose.py tests/test_root_cause.py -k "oom or cap"`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from verlaudit import verl_keys as V
from verlaudit.analysis.causes import Cause, Fix
from verlaudit.analysis.diagnose.failure import (
    capacity,
    failing_phases,
    memory_at_failure,
    need_gib,
    run_plan_inputs,
    run_world_size,
)
from verlaudit.analysis.diagnose.runview import cfg, fmt, gib, num, role_policy, uses_reference
from verlaudit.plan.memory_model import Estimate
from verlaudit.plan.planner import plan_config
from verlaudit.rundir import RunDir, to_float


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A fix and the config change the planner checks it with (None: not a config change)."""

    fix: Fix
    changes: Mapping[str, Any] | None
    gpus: int | None = None


def planned_need(
    run: RunDir, c: Candidate, allocator_cap: bool, scope: tuple[str | None, str | None] | None = None
) -> float | None:
    """GiB per GPU the run would need with the candidate's change: over the whole step, or with
    ``scope`` (trainer phase, forward the traceback shows) over the planner phases a failure there can
    be in. None when the change cannot be planned."""
    needs = phase_needs(run, c, allocator_cap, scope)
    return max(needs.values()) if needs else None


def phase_needs(
    run: RunDir, c: Candidate, allocator_cap: bool, scope: tuple[str | None, str | None] | None = None
) -> dict[str, float] | None:
    """`planned_need` per planner phase (name -> GiB)."""
    if c.changes is None:
        return None
    try:
        config, _, w, optimizer = run_plan_inputs(run, c.changes)
        est = plan_config(config, gpus=c.gpus or w, optimizer=optimizer)[0]
    except ValueError:
        return None
    phases = failing_phases(est, *scope) if scope is not None else est.phases
    return {p.name: need_gib(Estimate((p,)), allocator_cap) for p in phases}


def _lowers(new: dict[str, float], cur: dict[str, float] | None) -> bool:
    """Lowers some phase where the run may have failed and raises none (1% either way is noise)."""
    if not cur:
        return True
    common = [k for k in cur if k in new]
    return any(new[k] < 0.99 * cur[k] for k in common) and all(new[k] <= 1.01 * cur[k] for k in common)


# long: the evidence lines of one cause, assembled in the order they print
def oom_cause(run: RunDir) -> Cause:
    """The cause of a run whose status says ``oom``."""
    st = run.status or {}
    phase, step = st.get("phase"), st.get("step")
    mem = st.get("memory") or {}
    ev = [
        f"out of memory at step {step}, phase {phase}"
        + (f", in {st['where']}" + (f" ({st['role']})" if st.get("role") else "") if st.get("where") else "")
    ]
    if st.get("error"):
        ev.append(f"error: {str(st['error'])[:300]}")
    shown = {k: v for k, v in mem.items() if isinstance(v, (int, float))}
    if shown:
        ev.append(
            "allocator/device view (GiB): " + ", ".join(f"{k}={fmt(float(v))}" for k, v in shown.items())
        )
    for k, v in mem.items():
        if isinstance(v, Mapping) and v:
            ev.append(f"{k}: " + ", ".join(f"{p}={fmt(to_float(x))}" for p, x in v.items() if num(x)))
    emu = run.manifest.get("emulation") or {}
    cap, allocator_cap = capacity(run)
    if allocator_cap:
        ev.append(
            f"memory cap {gib(cap)} GiB on the caching allocator (torch.cuda.set_per_process_memory_fraction) "
            f"emulating {emu.get('target')}; the CUDA context is outside it"
        )
    unknown: list[str] = []
    est = None
    try:
        est = memory_at_failure(run, phase, step)
    except ValueError as e:
        unknown.append(f"memory classes: the planner cannot model this run ({e})")
    if est is not None:
        against = "against the allocator cap" if est.allocator_cap else "on the device with the CUDA context"
        ev.append(
            f"planner at '{est.phase}'"
            + (f" (the traceback shows the {est.pass_shown})" if est.pass_shown else "")
            + ": "
            + ", ".join(f"{k} {v:.3g}" for k, v in list(est.components.items())[:6])
            + f" GiB (allocated {est.allocated:.3g} GiB; {est.need:.3g} GiB with the allocator's reserve {against})"
        )
        ev.append("by class: " + ", ".join(f"{k} {v:.3g} GiB" for k, v in est.classes.items()))
        ev += [f"planner assumed: {n}" for n in est.notes]
    dominant = est.dominant if est else None
    reserved, allocated = num(mem.get("reserved_gb")), num(mem.get("allocated_gb"))
    fragmented = bool(reserved and allocated is not None and reserved - allocated > 0.25 * reserved)
    title = f"Out of memory in {phase or '?'} at step {step}" + (
        f"; {dominant} dominate ({est.classes[dominant]:.3g} of {est.allocated:.3g} GiB by the planner)"
        if est
        else ""
    )
    what = f"The device ran out of memory during {phase}."
    if est is not None:
        room = (
            f"{gib(est.capacity)} GiB" + (" (allocator cap)" if est.allocator_cap else "")
            if est.capacity
            else "an unknown capacity"
        )
        what += f" The planner puts '{est.phase}' at {est.need:.3g} GiB against {room}; {dominant} are the largest class."
        if est.capacity and est.need < est.capacity:
            what += (
                " That is below the capacity, so memory the planner does not model (another process, "
                "fragmentation, user code, a different model than the config names) made the difference."
            )
    if fragmented:
        what += f" The allocator held {reserved - allocated:.3g} GiB reserved but unallocated: fragmentation."
    scope = (phase, est.pass_shown if est else None)
    fixes, notes = checked_fixes(run, candidates(run, phase, dominant, fragmented), cap, allocator_cap, scope)
    return Cause(
        "error",
        "oom",
        title,
        what,
        evidence=ev,
        fixes=fixes,
        unknown=unknown + notes,
        step=step,
        where=phase,
        score=50.0,
        phase=phase,
        role=st.get("role"),
        data={
            "phase": phase,
            "memory": mem,
            "dominant": dominant,
            "estimate": dataclasses.asdict(est) if est else None,
        },
    )


# long: each candidate fix planned where it is proposed, so its numbers and its text stay together
def candidates(run: RunDir, phase: str | None, dominant: str | None, fragmented: bool) -> list[Candidate]:
    """Every fix for the dominating memory class, with the config change that checks it."""
    mb = cfg(run, "algo", "micro_batch_size")
    half = max(1, mb // 2) if isinstance(mb, int) else None
    role = "critic" if phase in ("critic_update", "critic") else "actor"
    out: list[Candidate] = []
    ref_fp32 = uses_reference(run) and role_policy(run, "reference").get("param_dtype") == "fp32"
    if dominant == "activations" or (dominant is None and phase in ("actor_update", "critic_update")):
        kept = cfg(run, "precision", "checkpoint_layers")
        ckpt_on = cfg(run, "precision", "grad_checkpointing")
        if isinstance(ckpt_on, Mapping):  # per role
            ckpt_on = ckpt_on.get(role, False)
        if ckpt_on and isinstance(kept, int) and not isinstance(kept, bool):
            # selective checkpointing kept some layers' activations: checkpoint them all
            out.append(
                Candidate(
                    Fix(
                        "precision.checkpoint_layers: auto (or unset: every layer)",
                        V.grad_ckpt(role),
                        f"only the first {kept} decoder layers were checkpointed; the rest kept their "
                        "activations",
                    ),
                    {"precision": {"checkpoint_layers": None}},
                )
            )
        elif not ckpt_on:
            out.append(
                Candidate(
                    Fix(
                        "precision.grad_checkpointing: true",
                        V.grad_ckpt(role),
                        "recompute activations in backward instead of keeping every layer's",
                    ),
                    {"precision": {"grad_checkpointing": True}},
                )
            )
        if half and half < mb:
            out.append(
                Candidate(
                    Fix(
                        f"algo.micro_batch_size: {half}",
                        V.micro_batch(role),
                        "activations scale with the micro-batch; gradient accumulation keeps the "
                        "effective batch",
                    ),
                    {"algo": {"micro_batch_size": half}},
                )
            )
    if dominant in ("optimizer state", "parameters", "gradients"):
        gpus = run_world_size(run) * 2
        if (cfg(run, "precision", "preset") or "") != "bf16-pure":
            out.append(
                Candidate(
                    Fix(
                        "precision.preset: bf16-pure",
                        V.MODEL_DTYPE_BF16,
                        "bf16 parameters and AdamW moments halve the model-state memory (fp32 master "
                        "copy dropped)",
                    ),
                    {"precision": {"preset": "bf16-pure"}},
                )
            )
        out.append(
            Candidate(
                Fix(
                    f"hardware.gpus: {gpus}",
                    f"{V.N_GPUS} (FSDP shards params/grads/optimizer)",
                    "sharding divides model state by the number of GPUs",
                ),
                {},
                gpus,
            )
        )
        if ref_fp32:
            out.append(
                Candidate(
                    Fix(
                        "precision.overrides.reference.param_dtype: bf16",
                        V.REF_PARAM_OFFLOAD,
                        "the frozen reference needs no fp32 copy",
                    ),
                    {"precision": {"overrides": {"reference": {"param_dtype": "bf16"}}}},
                )
            )
    if phase == "ref" and ref_fp32 and dominant not in ("optimizer state", "parameters", "gradients"):
        out.append(
            Candidate(
                Fix(
                    "precision.overrides.reference.param_dtype: bf16",
                    V.REF_LOG_PROB_MICRO_BATCH,
                    "a bf16 reference halves its weights and its forward",
                ),
                {"precision": {"overrides": {"reference": {"param_dtype": "bf16"}}}},
            )
        )
    if phase == "rollout" or dominant == "kv cache + rollout logits":
        r = cfg(run, "data", "response_length")
        b = cfg(run, "algo", "batch_size")
        if isinstance(r, int) and r > 1:
            out.append(
                Candidate(
                    Fix(
                        f"data.response_length: {r // 2}",
                        V.MAX_RESPONSE_LENGTH,
                        "the KV cache grows with sequence length",
                    ),
                    {"data": {"response_length": r // 2}},
                )
            )
        if isinstance(b, int) and b > 1:
            out.append(
                Candidate(
                    Fix(
                        f"algo.batch_size: {b // 2}",
                        f"{V.GPU_MEMORY_UTILIZATION} (vLLM/SGLang)",
                        "fewer sequences generated at once",
                    ),
                    {"algo": {"batch_size": b // 2}},
                )
            )
    if fragmented:
        out.append(
            Candidate(
                Fix(
                    None,
                    V.ALLOC_CONF,
                    "reduces fragmentation (the allocator held reserved memory it could not use)",
                ),
                None,
            )
        )
    return out


def checked_fixes(
    run: RunDir,
    cands: Sequence[Candidate],
    cap: float | None,
    allocator_cap: bool,
    scope: tuple[str | None, str | None],
) -> tuple[list[Fix], list[str]]:
    """The candidates the planner says work: with a capacity, those whose planned step fits it (else the
    first combination of them that fits); without one, those that lower the need of a planner phase
    where the run may have failed (``scope``) and raise none. Fixes that are not a config change come from the audit's own evidence (fragmentation)
    and are kept. Returns the fixes (each with the planner's numbers in its why) and notes for what
    could not be checked."""
    out: list[Fix] = []
    tried: list[tuple[Candidate, float]] = []
    notes: list[str] = []
    # without a capacity, changes are compared without the CUDA context (the same in both)
    measure = allocator_cap or cap is None
    current = phase_needs(run, Candidate(Fix(None), {}), measure, scope)
    for c in cands:
        if c.changes is None:
            out.append(c.fix)
            continue
        needs = phase_needs(run, c, measure, None if cap is not None else scope)
        if not needs:
            notes.append(f"{c.fix.suite}: the planner cannot model this change, so it is not offered")
            continue
        need = max(needs.values())
        tried.append((c, need))
        if need <= cap if cap is not None else _lowers(needs, current):
            out.append(_with_need(c.fix, need, cap, allocator_cap))
    if not any(f.suite for f in out) and tried and cap is not None:
        combo = _combination(run, [c for c, _ in tried if c.gpus is None], allocator_cap, cap)
        if combo is not None:
            fixes, need = combo
            joined = ", ".join(f.suite or "" for f in fixes)
            out.insert(
                0,
                Fix(
                    joined,
                    "; ".join(f.verl or "" for f in fixes),
                    f"no single change fits; together they do (planner: {need:.3g} GiB needed of "
                    f"{gib(cap)}{' allocator cap' if allocator_cap else ''}: fits)",
                ),
            )
        else:
            least = min(n for _, n in tried)
            notes.append(
                f"no change the planner knows fits {gib(cap)} GiB: the smallest planned need is "
                f"{least:.3g} GiB; a GPU with more memory or more GPUs"
            )
    return out, notes


def _with_need(fix: Fix, need: float, cap: float | None, allocator_cap: bool) -> Fix:
    if cap is None:
        note = f" (planner: lowers it to {need:.3g} GiB per GPU in the allocator)"
    else:
        note = f" (planner: {need:.3g} GiB needed of {gib(cap)}{' allocator cap' if allocator_cap else ''}: fits)"
    return dataclasses.replace(fix, why=fix.why + note)


def _combination(
    run: RunDir, cands: Sequence[Candidate], allocator_cap: bool, cap: float
) -> tuple[list[Fix], float] | None:
    """The shortest prefix of ``cands`` whose changes together fit ``cap``, with its planned need."""
    merged: dict[str, Any] = {}
    for n, c in enumerate(cands, 1):
        for section, values in (c.changes or {}).items():
            merged[section] = {**merged.get(section, {}), **values}
        need = planned_need(run, Candidate(c.fix, merged), allocator_cap)
        if n > 1 and need is not None and need <= cap:
            return [x.fix for x in cands[:n]], need
    return None
