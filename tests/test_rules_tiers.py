"""The general tier rule of the root-cause order (verlaudit/analysis/diagnose/rules.py `by_tier`): a cause of
an earlier tier (setup > config > data/plug-in > dynamics) explains a symptom of the training outcome on a
shared channel, so a finding that explains "no learning signal" or "optimizer steps skipped" heads it and
the symptom is marked as its consequence, without a pair for each combination."""

from __future__ import annotations

from verlaudit import kinds as K
from verlaudit.analysis.causes import Cause, Fix
from verlaudit.analysis.diagnose.diagnosis import order_by_root
from verlaudit.analysis.diagnose.rules import RULES, TIER_CHANNELS, TIERS, by_tier, explains


def test_every_tiered_class_is_registered_and_symptoms_are_last():
    for cls, (tier, channels) in TIER_CHANNELS.items():
        assert cls in K.CLASSES, cls
        assert tier in TIERS and channels
    assert all(TIER_CHANNELS[c][0] == "symptom" for c in ("overflow", "no_signal", "nonfinite"))


def test_an_earlier_tier_explains_a_symptom_on_its_channel_only():
    assert by_tier("config_scaler", "overflow") is not None  # a key that scales the loss -> skipped steps
    assert by_tier("tokenizer_ids", "no_signal") is not None  # data that empties the prompt -> equal rewards
    assert by_tier("setup_dtype", "overflow") is not None
    assert by_tier("learning_rate", "overflow") is not None  # dynamics before symptoms
    # not the other way, not between symptoms, not across channels
    assert by_tier("overflow", "config_scaler") is None
    assert by_tier("overflow", "no_signal") is None
    assert by_tier("config_scaler", "no_signal") is None
    assert by_tier("tokenizer_ids", "overflow") is None
    # a root explained by a root stays a matter of explicit pairs
    assert by_tier("config_scaler", "learning_rate") is None
    # the pairs still answer first
    assert explains("reward_integer", "no_signal") is RULES[("reward_integer", "no_signal")]


def _cause(kind, cls, step, phase, sev="warning", role="actor", fix=None):
    return Cause(sev, kind, f"{kind} title", "what", step=step, phase=phase, role=role, cls=cls,
                 fixes=[Fix(fix)] if fix else [], score={"error": 2.0, "warning": 1.0}[sev])  # fmt: skip


def test_a_data_finding_heads_the_missing_signal_it_explains():
    # the symptom is an error ranked first; the data finding found at the rollout explains it
    silent = _cause("no_signal", "no_signal", 0, "reward", sev="error", fix="algo.group_size: 8")
    prompts = _cause(
        f"finding:{K.TOKENIZER_SPECIAL_IDS}", "tokenizer_ids", 0, "rollout", fix="model.tokenizer: <yours>"
    )
    out = order_by_root([silent, prompts])
    assert out[0] is prompts and out[0].severity == "error"
    assert out[1].consequence_of == prompts.title and out[1].fixes == []


def test_a_config_key_heads_the_skipped_steps_and_an_unrelated_symptom_stays_apart():
    skips = _cause("overflow_skips", "overflow", 3, "actor_update", fix="precision.preset: bf16")
    key = _cause(f"finding:{K.CONFIG_SCALER}", "config_scaler", None, None, fix="x: 2000")
    silent = _cause("no_signal", "no_signal", 0, "reward")
    out = order_by_root([skips, silent, key])
    assert out[0] is key and skips.consequence_of == key.title and skips.fixes == []
    assert silent.consequence_of is None  # the scaler does not explain equal rewards
