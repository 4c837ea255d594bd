"""Setup before step: the causes that exist before the first step, and how they take the head of
what they explain.

- `override_causes`: a role's precision set by ``precision.overrides`` away from the preset's own
  contract (resolved policy in manifest.json against `trainer.precision.resolve_policy` of the preset
  alone), in the direction that loses something: weights stored below the preset's (no fp32 master
  copy: ``override_storage``), a role computing below it (``override_compute``), loss scaling other
  than the preset's (``override_scaling``). Each names the suite key and the value that restores the
  contract. It is ``info`` (a deliberate choice is not a fault) unless it explains a later finding
  (the rules make it the root, then it takes that finding's severity), or it makes the KL anchor
  coarser than the actor it anchors: a reference computing below the actor measures rounding in the
  KL term from step 0 (a warning, with the KL the run logged at its first step).
- `absorb`: a ``model.setup`` change (`verlaudit.audit.setup_changes`) that explains a finding about
  the same model's state (its parameter dtypes, a module's output, its ties, vocabulary, dropout, or
  a module the setup touched) hands the head of its chain to that finding, which says what is wrong,
  and names the setup function in its title: the finding is the root, the setup function its culprit.
  A change that explains nothing and is no warning of its own is dropped (`explains_nothing`).

Exercised by `pytest tests/test_setup_cause.py`.
"""

from __future__ import annotations

from typing import Any

from trainer.precision import resolve_policy
from verlaudit.analysis.causes import Cause, Fix
from verlaudit.analysis.diagnose.rules import Moment
from verlaudit.analysis.diagnose.runview import fmt, preset, role_policy, uses_reference
from verlaudit.rundir import RunDir

SETUP_CLASSES = frozenset(
    {
        "setup_dtype",
        "setup_vocab",
        "setup_trainable",
        "setup_ties",
        "setup_modules",
        "setup_hooks",
        "setup_mode",
    }
)
"""Classes of the ``setup/*`` findings (`verlaudit.kinds`)."""
EFFECT_CLASSES = frozenset(
    {"setup_settings", "setup_interface", "setup_adapter", "setup_collapse", "setup_shared"}
)
"""setupg: classes of what a setup changed in what a model computes (`verlaudit.audit.setup_effect`):
roots in their own words (they say what is wrong), dropped like the others when info and unexplaining."""
STATE_CLASSES = frozenset(
    {
        "param_dtype",
        "buffer_dtype",
        "module_output_dtype",
        "module_input_dtype",
        "compute_dtype",
        "tied_weights",
        "vocab",
        "dropout",
    }
)
"""Findings about a model's own state: one a setup change explains says what the change broke."""
_BITS = {"fp32": 3, "fp64": 4, "bf16": 1, "fp16": 1}
_KL_KEYS = ("rollout/kl_ref", "actor/kl_loss", "actor/kl")


def _lower(got: Any, base: Any) -> bool:
    return (
        got != base and _BITS.get(str(got), 0) < _BITS.get(str(base), 0) or (got == "fp16" and base == "bf16")
    )


def _overridden(run: RunDir, role: str) -> set[str]:
    reasons = role_policy(run, role).get("reasons") or {}
    return {k for k, r in reasons.items() if isinstance(r, str) and r.startswith("per-role override")}


def _kl_at_start(run: RunDir) -> tuple[str, float] | None:
    for key in _KL_KEYS:
        s = run.series(key)
        if s and s[0][1] != 0:
            return key, s[0][1]
    return None


def _cause(kind: str, role: str, key: str, title: str, what: str, fixes: list[Fix], severity="info", ev=()):
    return Cause(
        severity,
        kind,
        title,
        what,
        evidence=[f"manifest.json policy: {role} {key}", *ev],
        fixes=fixes,
        step=None,
        where=f"precision.overrides.{role}.{key}",
        role=role,
        seq=-1.0,
    )


# long: one branch per part of the contract (scaling, storage, compute), each with its own words and fix
def override_causes(run: RunDir) -> list[Cause]:
    """The roles' precision overrides that depart from the preset's contract (module docstring)."""
    name = preset(run)
    try:
        base = resolve_policy(name).roles if name else None
    except (ValueError, TypeError):
        return []
    if not base:
        return []
    out: list[Cause] = []
    for role, contract in base.items():
        keys = _overridden(run, role)
        got = role_policy(run, role)
        if not keys or not got:
            continue
        want = contract.to_dict() if hasattr(contract, "to_dict") else {}
        scaling = {k for k in ("loss_scaling", "init_scale") if k in keys and got.get(k) != want.get(k)}
        if scaling and want.get("loss_scaling") != "none":
            ls, init = got.get("loss_scaling"), got.get("init_scale")
            how = (
                f"a static scale of {fmt(float(init))} never backs off, so every step whose scaled gradients "
                "overflow fp16 is skipped"
                if ls == "static"
                else "unscaled fp16 gradients below fp16's smallest normal underflow to zero"
                if ls == "none"
                else f"the scaler starts from {fmt(float(init))}"
            )
            key = "loss_scaling" if "loss_scaling" in scaling else "init_scale"
            base_init = float(want.get("init_scale") or 65536)
            fixes = [
                Fix(
                    f"precision.overrides.{role}.loss_scaling: dynamic",
                    None,
                    "the preset's dynamic scaler backs off on overflow and grows while gradients are small",
                )
            ]
            if "init_scale" in scaling:
                fixes.append(
                    Fix(
                        f"precision.overrides.{role}.init_scale: {base_init:g}",
                        None,
                        "the preset's first scale",
                    )
                )
            out.append(
                _cause(
                    "override_scaling",
                    role,
                    key,
                    f"precision.overrides.{role}.{key}: {got.get(key)} replaces the {name} preset's dynamic "
                    f"loss scaling of the {role}'s fp16 gradients: {how}",
                    f"The {name} preset scales the {role}'s fp16 loss dynamically from {fmt(base_init)}; the "
                    "override replaces it.",
                    fixes,
                )
            )
        pd, bpd = got.get("param_dtype"), want.get("param_dtype")
        if "param_dtype" in keys and _lower(pd, bpd):
            trains = bool(got.get("trainable"))
            out.append(
                _cause(
                    "override_storage",
                    role,
                    "param_dtype",
                    f"precision.overrides.{role}.param_dtype: {pd} stores the {role}'s weights in {pd} where the "
                    f"{name} preset keeps {bpd} master weights"
                    + (
                        f": the optimizer's state and updates are {pd} too (AdamW's eps 1e-8 is 0 in fp16, small "
                        "updates round away)"
                        if trains
                        else ""
                    ),
                    f"The override takes the {role}'s {bpd} master copy away from the preset's contract.",
                    [
                        Fix(
                            f"precision.overrides.{role}.param_dtype: {bpd}",
                            None,
                            f"the preset's {bpd} master weights (compute stays {got.get('compute_dtype')})",
                        )
                    ],
                )
            )
        cd, bcd = got.get("compute_dtype"), want.get("compute_dtype")
        if "compute_dtype" in keys and _lower(cd, bcd):
            actor_cd = role_policy(run, "actor").get("compute_dtype")
            anchor = role == "reference" and uses_reference(run) and _lower(cd, actor_cd)
            kl = _kl_at_start(run) if anchor else None
            title = f"precision.overrides.{role}.compute_dtype: {cd} computes the {role} in {cd} where the {name} preset computes it in {bcd}"
            if anchor:
                title += (
                    f", while the actor computes in {actor_cd}: the KL to the reference measures {cd} rounding "
                    "from step 0" + (f" ({kl[0]} = {kl[1]:.3g} at the first step, not 0)" if kl else "")
                )
            out.append(
                _cause(
                    "override_compute",
                    role,
                    "compute_dtype",
                    title,
                    f"The override computes the {role} below the preset's {bcd}.",
                    [
                        Fix(
                            f"precision.overrides.{role}.compute_dtype: {bcd}",
                            None,
                            f"the preset's {bcd} compute for the {role}"
                            + (
                                f" (and param_dtype {bpd}): the reference then is the actor's start exactly"
                                if anchor
                                else ""
                            ),
                        )
                    ],
                    severity="warning" if anchor else "info",
                    ev=[f"first-step {kl[0]} = {kl[1]:.3g}"] if kl else (),
                )
            )
    return out


def explains_nothing(c: Cause) -> bool:
    """A setup or override cause of severity info that no rule tied to anything: dropped."""
    return (
        c.severity == "info"
        and not c.chain
        and c.consequence_of is None
        and ((c.cls or "") in SETUP_CLASSES | EFFECT_CLASSES or c.kind.startswith("override_"))
    )


def _touched(c: Cause) -> set[str]:
    obs = c.data.get("observed") if isinstance(c.data.get("observed"), dict) else {}
    names = set()
    for n in [obs.get("module"), *(obs.get("names") or []), *(obs.get("modules") or [])]:
        if isinstance(n, str) and n:
            names.add(n)
            names.add(n.rsplit(".", 1)[0])
    for r in obs.get("replaced") or []:
        if isinstance(r, (list, tuple)) and r:
            names.add(str(r[0]))
    return names


def _model(role: str | None) -> str | None:
    return "actor" if role == "rollout" else role


def absorb(root: Cause, cons: list[Cause], target: Cause | None = None) -> Cause | None:
    """The consequence that takes the head of a setup change's chain (module docstring), or None:
    the earliest finding about the model's state it explains, else ``target`` (the most important
    cause the chain was followed back from) when it is where the setup touched, else the earliest
    cause there."""
    if (root.cls or "") not in SETUP_CLASSES:
        return None
    touched = _touched(root)
    mine = [c for c in cons if _model(c.role) == _model(root.role)]
    state = [c for c in mine if (c.cls or "") in STATE_CLASSES]
    at = [c for c in mine if c.where and {c.where, c.where.rsplit(".", 1)[0]} & touched]
    # what the change broke in the model itself, else the first thing that went wrong where it touched
    if state:
        return min(state, key=lambda c: Moment.of(c.step, c.phase, c.seq))
    if target is not None and target in at:
        return target
    return min(at, key=lambda c: Moment.of(c.step, c.phase, c.seq)) if at else None


def take_over(setup: Cause, head: Cause, cons: list[Cause]) -> list[Cause]:
    """``head`` as the root of ``setup``'s chain, the setup function named as its culprit."""
    head.title = f"{head.title} (from {setup.where})"
    head.evidence = [setup.what, *head.evidence]
    head.fixes = list(dict.fromkeys([*head.fixes, *setup.fixes]))[:4]
    head.data = {**head.data, "setup": setup.where}
    return [c for c in cons if c is not head]
