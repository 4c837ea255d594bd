"""data13's own end-to-end members of the data-information family (not bench items): writes one suite per
member onto blind bench 6's base configs. Run, from the repository root:

    python benchmarks/data13_members/make_suites.py OUT_DIR SFT_CHECKPOINT_DIR
    for s in OUT_DIR/*.yaml; do python -m verlaudit run $s --out OUT_DIR/runs/$(basename $s .yaml) --device cpu; done

then ``verlaudit diagnose`` each run (SFT_CHECKPOINT_DIR: blind bench 6's ``sft_lm`` asset)."""

import copy
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "blind_faults_6"))
import faults as F  # noqa: E402
from faultbench import merge  # noqa: E402

P = f"{HERE / 'plugins_mine.py'}:"


def main(out: Path, sft: str) -> None:
    items = {
        "own_numpy_reseeded": ("grpo", "fp32", {"data": {"dataset": P + "numpy_reseeded"}}),
        "own_smoke_slice": ("ppo", "bf16", {"data": {"dataset": P + "smoke_slice"}}),
        "own_dotted_pairs": ("dpo", "fp16", {"data": {"dataset": P + "dotted_pairs"}}),
        "own_sorted_rejected": ("dpo", "bf16", {"data": {"collator": P + "sorted_rejected"}}),
        "own_newline_prompts": (
            "grpo",
            "fp32",
            {"model": {"path": sft}, "data": {"dataset": P + "newline_prompts"}},
        ),
        "own_ctl_sft_grpo": ("grpo", "bf16", {"model": {"path": sft}}),
    }
    out.mkdir(parents=True, exist_ok=True)
    for name, (algo, preset, train) in items.items():
        t = merge(F.BASE[algo], train)
        if t["model"].get("path"):
            t["model"].pop("preset", None)
        suite = {"name": name, "description": name, "train": t, "seeds": [0], "hardware": {"target": "cpu"},
                 "audit": copy.deepcopy(F.AUDIT[algo]), "report": {"trailing_window": 2, "plots": False},
                 "variants": {name: {"precision": {"preset": preset}}}}  # fmt: skip
        (out / f"{name}.yaml").write_text(yaml.safe_dump(suite, sort_keys=False))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
