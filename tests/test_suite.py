"""Suite loading: shipped suites validate, overrides apply, and malformed suites fail with the field path.

Run: `pytest -q tests/test_suite.py`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verlaudit.run.suite import Suite, deep_merge, load_suite, read_yaml

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted((ROOT / "suites").glob("*.yaml"))


def test_suites_are_shipped():
    names = {p.stem for p in SHIPPED}
    assert {"tiny_cpu", "llama7b_2xa100", "dpo_tiny_cpu", "grpo_tiny_cpu"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_suite_validates_and_starts_with_its_command(path: Path):
    suite = load_suite(path)
    assert suite.name == path.stem
    assert len(suite.expand()) == len(suite.variants) * len(suite.seeds)
    first = path.read_text().splitlines()[0]
    assert first.startswith("# Run: verlaudit run suites/" + path.name), first
    # to_dict -> from_dict gives the same suite (the report dir keeps this copy for `compare`)
    again = Suite.from_dict(suite.to_dict(), source=suite.source)
    assert again.variants == suite.variants and again.seeds == suite.seeds


def test_llama7b_suite_is_the_seed_experiment():
    s = load_suite(ROOT / "suites/llama7b_2xa100.yaml")
    assert (s.hardware.target, s.hardware.gpus, s.train.steps) == ("a100-80gb", 2, 1000)
    assert s.train.model.preset == "llama2-7b"
    # GRPO: 8 prompts x 4 samples = 32 sequences of 512 + 512 = 1024 tokens
    algo, data = s.train.algo, s.train.data
    assert algo.batch_size * algo.group_size == 32 and data.prompt_length + data.response_length == 1024
    assert {k: (v.precision.preset, v.sharding) for k, v in s.variants.items()} == {
        "bf16-ckpt": ("bf16", "full_shard"),
        "bf16-ckpt-shard-grad-op": ("bf16", "shard_grad_op"),
        "fp16": ("fp16", "full_shard"),
        "fp32": ("fp32", "full_shard"),
    }
    assert s.variants["bf16-ckpt"].precision.grad_checkpointing is True
    # 2 ranks: every global size splits evenly; the rollout decodes fused (a snapshot gathered once
    # per rollout), the only way CUDA graphs and compile are allowed under FSDP2
    assert algo.batch_size % 2 == 0 and algo.mini_batch_size % 2 == 0
    r = s.train.rollout
    assert (r.engine, r.cuda_graphs, r.compile) == ("fused", True, True)


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return p


BASE = """\
name: t
train:
  steps: 7
  algo: {name: ppo, lr: 0.001, batch_size: 8, mini_batch_size: 8, micro_batch_size: 4}
  precision: {preset: fp32, overrides: {critic: {compute_dtype: fp32}}}
variants:
  a: {}
  b:
    algo: {lr: 0.01}
    precision: {preset: bf16, grad_checkpointing: true}
"""


def test_variants_deep_merge_onto_base(tmp_path):
    s = load_suite(_write(tmp_path, BASE))
    a, b = s.variants["a"], s.variants["b"]
    assert a.algo.lr == 0.001 and b.algo.lr == 0.01
    # b changed only lr inside algo: the rest of the base's algo survives the merge
    assert b.algo.batch_size == 8 and b.algo.micro_batch_size == 4 and b.steps == 7
    assert b.precision.preset == "bf16" and b.precision.grad_checkpointing is True
    assert dict(b.precision.overrides) == {"critic": {"compute_dtype": "fp32"}}
    assert s.seeds == (0,) and [r.run_name for r in s.expand()] == ["a", "b"]


def test_deep_merge_replaces_non_mappings_and_copies():
    base = {"x": {"y": 1, "z": [1]}, "g": False}
    out = deep_merge(base, {"x": {"y": 2}, "g": {"actor": True}})
    assert out == {"x": {"y": 2, "z": [1]}, "g": {"actor": True}}
    out["x"]["z"].append(2)
    assert base["x"]["z"] == [1]


def test_command_line_overrides(tmp_path):
    p = _write(tmp_path, BASE)
    s = load_suite(p, steps=2, variants=["b"], seeds=[3, 5], device="cpu", audit_level="off")
    assert list(s.variants) == ["b"] and s.audit.level == "off"
    runs = s.expand()
    assert [(r.run_name, r.seed, r.config.steps, r.config.device) for r in runs] == [
        ("b-s3", 3, 2, "cpu"),
        ("b-s5", 5, 2, "cpu"),
    ]
    with pytest.raises(ValueError, match=r"--variants: zz not in .*expected some of a, b"):
        load_suite(p, variants=["zz"])
    with pytest.raises(ValueError, match="--steps: must be >= 1"):
        load_suite(p, steps=0)
    with pytest.raises(ValueError, match="--device: 'tpu'"):
        load_suite(p, device="tpu")


@pytest.mark.parametrize(
    "text, flags, message",
    [
        # the file is validated as written: a valid --steps does not hide an invalid steps: in it
        (
            "name: t\ntrain: {steps: 0}\nvariants: {a: {}}\n",
            {"steps": 3},
            r"s\.yaml: train\.steps: must be >= 1",
        ),
        (
            "name: t\ntrain: {}\nvariants: {a: {steps: -2}}\n",
            {"steps": 3},
            r"variants\.a\.steps: must be >= 1",
        ),
        ("name: t\ntrain: {device: tpu}\nvariants: {a: {}}\n", {"device": "cpu"}, r"train\.device: 'tpu'"),
        # a variants list is the same error with or without overrides (it was a traceback with them)
        ("name: t\ntrain: {}\nvariants: [a, b]\n", {"steps": 3}, r"variants: expected a non-empty mapping"),
        (
            "name: t\ntrain: {}\nvariants: [a, b]\n",
            {"device": "cpu"},
            r"variants: expected a non-empty mapping",
        ),
        ("name: t\ntrain: [1]\nvariants: {a: {}}\n", {"steps": 3}, r"train: expected a mapping"),
        ("name: t\ntrain: {}\nvariants: {a: {}}\n", {"seeds": [1, 1]}, r"seeds: repeated seed.*with --seeds"),
        # no train: section is an error that says what to add, never silent defaults
        ("name: t\nvariants: {a: {}}\n", {}, r"train: missing; .* write train: \{\} to take every default"),
        ("name: t\nvariants: {a: {}}\n", {"steps": 3}, r"train: missing"),
    ],
)
def test_the_file_is_validated_before_the_command_line_overrides(tmp_path, text, flags, message):
    with pytest.raises(ValueError, match=message):
        load_suite(_write(tmp_path, text), **flags)


def test_an_explicit_empty_train_section_takes_the_defaults(tmp_path):
    s = load_suite(_write(tmp_path, "name: t\ntrain: {}\nvariants: {a: {}}\n"), steps=4)
    assert s.train.model.preset == "tiny-llama" and s.variants["a"].steps == 4


def test_steps_override_beats_a_variant_that_sets_steps(tmp_path):
    p = _write(tmp_path, BASE.replace("  a: {}", "  a: {steps: 50}"))
    assert load_suite(p).variants["a"].steps == 50
    assert load_suite(p, steps=3).variants["a"].steps == 3


@pytest.mark.parametrize(
    "text, message",
    [
        ("name: t\n  bad: [\n", r"s\.yaml:2:\d+: YAML error"),
        ("name: t\nname: u\n", r"s\.yaml:2:1: YAML error: duplicate key 'name' \(first at line 1\)"),
        ("name: t\nvariants: {a: {}}\nbogus: 1\n", r"bogus: unknown key; expected one of .*variants"),
        ("name: t\nvariants: {}\n", r"variants: expected a non-empty mapping"),
        ("name: t\nvariants: {a: {algo: {lr: -1}}}\n", r"variants\.a\.algo\.lr: must be > 0"),
        (
            "name: t\nvariants: {a: {precision: {preset: bf61}}}\n",
            r"variants\.a\.precision\.preset: unknown preset 'bf61'; expected one of fp32, fp16, bf16, bf16-pure",
        ),
        ("name: t\ntrain: {algo: {lr: x}}\nvariants: {a: {}}\n", r"train\.algo\.lr: expected a number"),
        (
            "name: t\nhardware: {target: a200}\nvariants: {a: {}}\n",
            r"hardware\.target: unknown target 'a200'; expected one of cpu, t4",
        ),
        (
            "name: t\naudit: {level: most}\nvariants: {a: {}}\n",
            r"audit\.level: 'most'; expected one of off, boundary, full",
        ),
        ("name: t\nseeds: [0, zero]\nvariants: {a: {}}\n", r"seeds\[1\]: expected an integer"),
        ("name: t\nseeds: [1, 1]\nvariants: {a: {}}\n", r"seeds: repeated seed"),
        ("name: t\nvariants: {a: {seed: 3}}\n", r"variants\.a\.seed: set seeds for the whole suite"),
        ("name: t\nvariants: {a/b: {}}\n", r"variants\.a/b: bad variant name"),
        ("name: t\ncompare: [1]\nvariants: {a: {}}\n", r"compare: expected a mapping"),
        ("name: 't t'\nvariants: {a: {}}\n", r"name: 't t'; expected a name"),
        ("- 1\n", r"a suite is a mapping"),
    ],
)
def test_malformed_suites_name_the_field(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        load_suite(_write(tmp_path, text))


def test_missing_file_says_where_suites_are(tmp_path):
    with pytest.raises(ValueError, match="no such suite file; shipped suites are in suites/"):
        load_suite(tmp_path / "nope.yaml")


# --- hypothesis: any single corruption of a valid suite is a ValueError that names the field ---------

VALID = read_yaml(ROOT / "suites/tiny_cpu.yaml")
# mappings whose keys the suite validates (free-form ones such as compare or model.overrides excluded)
SECTIONS = [(), ("train",), ("train", "model"), ("train", "data"), ("train", "algo"), ("train", "precision"),
            ("hardware",), ("audit",), ("report",), ("variants", "fp16"), ("variants", "fp16", "precision")]  # fmt: skip


def _leaves(d: Any, path: tuple = ()) -> list[tuple]:
    if isinstance(d, dict) and d:
        return [leaf for k, v in d.items() for leaf in _leaves(v, (*path, k))]
    if isinstance(d, list) and d:
        return [(*path, i) for i in range(len(d))]
    return [path]


def _dotted(path: tuple) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _set(d: dict, path: tuple, value: Any) -> None:
    for part in path[:-1]:
        d = d[part]
    d[path[-1]] = value


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["wrong_type", "unknown_key"]),
    leaf=st.sampled_from([p for p in _leaves(VALID) if p[0] not in ("name", "description")]),
    section=st.sampled_from(SECTIONS),
    key=st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12),
)
def test_any_corruption_is_a_value_error_naming_the_field(kind, leaf, section, key):
    data = copy.deepcopy(VALID)
    if kind == "wrong_type":
        # a list is the wrong type for every scalar or mapping field; a list element gets a string
        bad: Any = "x" if isinstance(leaf[-1], int) else [1, 2]
        _set(data, leaf, bad)
        path = _dotted(leaf)
    else:
        target = data
        for part in section:
            target = target.setdefault(part, {})
        if key in target:
            return
        target[key] = 1
        path = _dotted((*section, key))
    with pytest.raises(ValueError) as info:
        Suite.from_dict(data, source="s.yaml")
    assert f"s.yaml: {path}:" in str(info.value), (path, str(info.value))


def test_compare_section_is_validated_when_the_suite_loads(tmp_path):
    # compare owns the keys' meaning; a typo must fail at `verlaudit run`, not days later in CI
    import pytest

    from verlaudit.run.suite import load_suite

    bad = tmp_path / "s.yaml"
    bad.write_text("name: x\ntrain: {steps: 1}\ncompare: {tolerances: {loss_atl: 1}}\nvariants: {a: {}}\n")
    with pytest.raises(ValueError, match=r"compare\.tolerances\.loss_atl: unknown tolerance"):
        load_suite(bad)
    bad.write_text("name: x\ntrain: {steps: 1}\ncompare: {gates: ['max(a/b) <']}\nvariants: {a: {}}\n")
    with pytest.raises(ValueError, match=r"compare\.gates\[0\]"):
        load_suite(bad)


GRPO_KL = """\
name: t
train:
  algo: {name: grpo, use_kl_loss: true, kl_loss_coef: 0.01, kl_loss_type: low_var_kl}
variants:
  grpo: {}
  dpo: {algo: {name: dpo, use_kl_loss: unset, kl_loss_coef: unset, kl_loss_type: unset}}
"""


def test_a_variant_resets_an_inherited_key_with_unset(tmp_path):
    s = load_suite(_write(tmp_path, GRPO_KL))
    grpo, dpo = s.variants["grpo"].algo, s.variants["dpo"].algo
    assert (grpo.use_kl_loss, grpo.kl_loss_coef) == (True, 0.01)
    defaults = type(dpo)()
    assert (dpo.name, dpo.use_kl_loss, dpo.kl_loss_coef) == ("dpo", False, defaults.kl_loss_coef)
    assert s.overrides["dpo"]["algo"]["use_kl_loss"] == "unset"  # kept as written, for the report
    assert Suite.from_dict(s.to_dict(), source=s.source).variants == s.variants


def test_an_inherited_key_nothing_reads_says_how_to_unset_it(tmp_path):
    text = GRPO_KL.replace(", use_kl_loss: unset, kl_loss_coef: unset, kl_loss_type: unset", "")
    with pytest.raises(ValueError) as e:
        load_suite(_write(tmp_path, text))
    assert "variants.dpo.algo.use_kl_loss: set to True but nothing reads it" in str(e.value)
    assert str(e.value).endswith(
        "it is inherited from train: write use_kl_loss: unset under variants.dpo.algo to drop it"
    )
    # a key the variant sets itself gets the message as it is: removing it is up to the variant
    with pytest.raises(ValueError) as e:
        load_suite(_write(tmp_path, text.replace("{name: dpo}", "{name: dpo, use_kl_loss: true}")))
    assert "inherited from train" not in str(e.value) and str(e.value).endswith("remove it")
