"""Fixes built from a finding's evidence, ahead of its kind's general advice: the change the numbers point to
(drop the few pairs that are equal, not rebuild them all; remove a re-initialisation, not copy it to the
reference), with the culprit the finding named. Each rule reads only what the finding observed and the run's
setup keys, so any member of the family that leaves the same evidence gets the same fix.

- ``boundary/identical_pairs`` in some of a batch's pairs, not all: the dataset is right for the others,
  so the fix is a filter (chosen != rejected) where it is built; in every pair it stays the kind's own
  (both sides are built from one field).
- ``model/reference_not_actor`` where the actor's weights differ from the reference's by the size of the
  weights themselves (relative difference >= `REPLACED`) and a ``model.setup`` ran on the actor: the setup
  replaced the loaded weights (a re-initialisation: reset_parameters, init.*, a new module), so the fix is
  to remove that from the setup; running it on the reference too would make both start from random weights.
- ``model/checkpoint_untrained`` naming model.path while a ``model.setup`` ran on the actor before the NLL
  was measured: the setup's change (a scaled head, a logit temperature, re-initialised layers) is named first.
- ``reward/follows_position`` and ``reward/not_repeatable`` of one reward function, no random state moved: the
  rewards move between rows both when the rows are reordered and when the same batch is scored again, as
  results gathered in completion order do: the fix keeps each result's row index.

- ``boundary/rollout_dtype`` where ``precision.overrides`` moved the actor's or the rollout's compute dtype off
  the preset's (`overrides_named`): the title names the override, whose fix (the preset's dtype) comes first.

`refine` is called by `verlaudit.analysis.diagnose.diagnosis` for each finding cause. Exercised by
`pytest tests/test_evidence_fix.py`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from verlaudit import kinds as K
from verlaudit.analysis.causes import Cause, Fix
from verlaudit.analysis.diagnose.runview import cfg, role_policy, setup_plugin
from verlaudit.rundir import Finding, RunDir

REPLACED = 0.9
"""Relative difference (||actor - reference|| / ||reference||) from which a weight was replaced, not changed:
new values of the same scale differ by about sqrt(2), zeros by 1; a scale or a small edit stays far below."""


_SUITE_KEY = re.compile(
    r"^(?:(?:data|algo|precision|rollout_correction)\.[\w.]+(?: \(.+\))?|model\.[\w.]+ \(.+\))$"
)
"""A finding's where that is a suite key (``algo.kl_coef``, ``data.dataset (ds.py:make)``, ``model.setup (s.py:f)``);
a module path (``model.layers.0.mlp``) is not: a ``model.`` key needs its plug-in in brackets."""


def suite_key(where: str | None) -> str | None:
    """``where`` when it names a suite key (the culprit a fix sets or edits), else None."""
    return where if where and _SUITE_KEY.match(where) else None


def _obs(f: Finding) -> dict:
    return f.observed if isinstance(f.observed, dict) else {}


def _identical_pairs(run: RunDir, fs: Sequence[Finding], key: str | None) -> tuple[str | None, Fix | None]:
    worst = max(fs, key=lambda f: _obs(f).get("identical_pairs") or 0)
    n, m = _obs(worst).get("identical_pairs"), _obs(worst).get("batch")
    if not isinstance(n, int) or not isinstance(m, int) or not 0 < n < m:
        return None, None
    return None, Fix(
        key,
        None,
        f"filter the pairs where the dataset is built: drop every pair whose chosen == rejected (keep chosen != "
        f"rejected); {n} of {m} pairs of a batch are equal and the others are distinct, so the pairs are built "
        "right and some are unfiltered duplicates (two samples that happened to agree)",
    )


def _reference_replaced(run: RunDir, fs: Sequence[Finding], key: str | None) -> tuple[str | None, Fix | None]:
    top = max(fs, key=lambda f: _obs(f).get("worst_rel") or 0)
    rel = _obs(top).get("worst_rel")
    plugin = setup_plugin(run, "actor")
    if not isinstance(rel, (int, float)) or rel < REPLACED or not plugin:
        return None, None
    field = "model.setup.actor" if isinstance(cfg(run, "model", "setup"), Mapping) else "model.setup"
    title = (
        f"; the setup overwrote the loaded weights: a relative difference of {rel:.3g} is new values "
        f"(a re-initialisation), not a change of the checkpoint's ({field} ({plugin}))"
    )
    return title, Fix(
        f"{field} ({plugin})",
        None,
        f"remove the re-initialisation from the setup (reset_parameters(), torch.nn.init.*, init_weights / "
        f"post_init, a freshly built module in place of a loaded one) so the actor starts from the checkpoint "
        f"({top.where or 'its weights'}: {rel:.3g} relative, the size of the weights themselves); running the "
        "setup on the reference too would only make both start from random weights",
    )


def _reward_order(run: RunDir, fs: Sequence[Finding], key: str | None) -> tuple[str | None, Fix | None]:
    where = fs[0].where
    other = K.REWARD_NOT_REPEATABLE if fs[0].kind == K.REWARD_FOLLOWS_POSITION else K.REWARD_FOLLOWS_POSITION
    twin = [f for f in run.findings if f.kind == other and f.where == where]
    if not twin or any(_obs(f).get("random_state_moved") for f in [*fs, *twin]):
        return None, None
    return None, Fix(
        key,
        None,
        "return the scores in the order of the rows it was handed: the same batch scored twice and the rows "
        "reordered both move rewards between rows without any random draw, as results collected in the order "
        "they complete do (concurrent.futures.as_completed, imap_unordered, a set or dict of results, a sort): "
        "keep each result's row index (executor.map keeps the order, or write scores[i] by the index each task "
        "carries); and keep no state that changes a row's score between calls",
    )


def _untrained_after_setup(
    run: RunDir, fs: Sequence[Finding], key: str | None
) -> tuple[str | None, Fix | None]:
    where = fs[0].where or ""
    plugin = setup_plugin(run, "actor")
    if not plugin or not where.startswith("model.path") or plugin in where:
        return None, None  # no setup, or the finding already names the setup that loaded the weights
    field = "model.setup.actor" if isinstance(cfg(run, "model", "setup"), Mapping) else "model.setup"
    title = (
        f"; {field} ({plugin}) ran on the actor before this was measured: what it changed in the loaded model "
        "is the first suspect, the checkpoint the second"
    )
    return title, Fix(
        f"{field} ({plugin})",
        None,
        "remove what the setup changes in the loaded model's outputs (a scaled or replaced output "
        "head, a temperature on the logits, re-initialised or remapped layers) and measure the checkpoint "
        "without it: if the checkpoint alone predicts the answers, the setup is the culprit",
    )


RULES = {
    K.WEIGHTS_UNTRAINED: _untrained_after_setup,
    K.IDENTICAL_PAIRS: _identical_pairs,
    K.REFERENCE_NOT_ACTOR: _reference_replaced,
    K.REWARD_FOLLOWS_POSITION: _reward_order,
    K.REWARD_NOT_REPEATABLE: _reward_order,
}
"""finding kind -> (run, its findings, the fix's suite key) -> (a title addition, the fix the evidence names)."""


def refine(
    run: RunDir, kind: str, fs: Sequence[Finding], fixes: list[Fix], title: str
) -> tuple[list[Fix], str]:
    """``fixes`` with the evidence's own fix first, ``title`` with what the evidence adds (unchanged when the
    kind has no rule or the evidence does not decide it)."""
    rule = RULES.get(kind)
    if rule is None or not fs:
        return fixes, title
    key = next((f.suite for f in fixes if f.suite), None)
    key = key or suite_key(fs[0].where)  # the suite key the finding names (data.dataset (file.py:fn))
    extra, fix = rule(run, fs, key)
    if fix is not None:
        fixes = [fix, *[f for f in fixes if f != fix]]
    return fixes, title + (extra or "")


_SIDES = ("actor", "rollout")
"""The two sides of the rollout dtype boundary: the engine samples, the actor recomputes."""


def overrides_named(causes: list[Cause]) -> list[Cause]:
    """The rollout dtype boundary that a compute override of one of its sides made: the boundary finding stays
    the root (it says what differs), its title names the override and the override's fix, which restores the
    preset's dtype, comes first (an override that moved the actor below the rollout, or the rollout below the
    actor)."""
    moved = [c for c in causes if c.kind == "override_compute" and c.role in _SIDES]
    if not moved:
        return causes
    for c in causes:
        if c.kind == f"{K.FINDING_PREFIX}{K.ROLLOUT_DTYPE}":
            c.title += " (" + "; ".join(f"from {o.title}" for o in moved) + ")"
            c.fixes = list(dict.fromkeys([*(f for o in moved for f in o.fixes), *c.fixes]))[:4]
    return causes


_MEASURED = {K.REWARD_MODEL_DTYPE: "param_dtype", K.PARAM_STORAGE: "param_dtype", K.COMPUTE: "compute_dtype"}
"""Findings that measure the dtype a role's model really has (its stored parameters, a linear's compute), and the
policy field they measure."""
_SOURCE = {"reward": "model.reward_model", "critic": "model.critic_path", "actor": "model.path"}


def _dtype_seen(f: Finding) -> str | None:
    obs = f.observed
    if isinstance(obs, str):
        return obs
    if isinstance(obs, dict) and len(obs) == 1 and isinstance(next(iter(obs)), str):
        return next(iter(obs))  # {"fp32": 3233}: every parameter in one dtype
    return None


def override_ignored_causes(run: RunDir) -> list[Cause]:
    """A ``precision.overrides.<role>`` field the role's model does not follow: the configured dtype is the
    policy's, the audit measured another on every parameter or in the compute (a loader or a setup that builds
    the module in its own dtype and never reads the role's precision). The measurements alone are info (a wider
    dtype loses no precision); against an explicit override they say the configured contract is not what runs."""
    overrides = cfg(run, "precision", "overrides", default=None)
    if not isinstance(overrides, Mapping):
        return []
    out: list[Cause] = []
    for role, fields in overrides.items():
        if not isinstance(fields, Mapping):
            continue
        policy = role_policy(run, role)
        seen = [
            f
            for f in run.findings
            if f.role == role and f.kind in _MEASURED and f.severity == "info" and _MEASURED[f.kind] in fields
        ]
        for f in seen:
            field = _MEASURED[f.kind]
            want, got = policy.get(field) or fields.get(field), _dtype_seen(f)
            if not got or not want or got == want or str(fields.get(field)) != str(want):
                continue
            source = _SOURCE.get(role, "model.path")
            spec = cfg(run, *source.split("."), default=None)
            plugin = setup_plugin(run, role)
            culprit = f"{source} ({spec})" if spec else f"model.setup ({plugin})" if plugin else source
            key = f"precision.overrides.{role}.{field}"
            out.append(
                Cause(
                    "warning",
                    "override_ignored",
                    f"{key}: {want} is configured, but the {role}'s model runs in {got} ({f.where or 'its modules'}): "
                    f"{culprit} builds it in its own dtype and never reads the role's precision, so configured and "
                    "effective precision differ",
                    f"The suite's override asks for {want} on the {role}; the audit measured {got} ({f.kind}: "
                    f"{f.message}). Whatever the override was for (memory, matching another role's rounding), it "
                    "does not happen, and the run's report states a contract the model does not keep.",
                    evidence=[f"{f.kind} on the {role} ({f.where}): {f.message}"],
                    fixes=[
                        Fix(
                            culprit,
                            None,
                            f"cast the model in the loader to the role's dtype (model.to(torch_dtype) / .half() for "
                            f"{want}, or read the dtype the trainer passes) so the override takes effect",
                        ),
                        Fix(f"{key}: {got}", None, f"or drop the override: the {role} runs in {got} anyway"),
                    ],
                    step=f.step,
                    where=culprit,
                    score=5.0,
                    role=role,
                    cls="override_ignored",
                )
            )
            break
    return out
