"""Per-step metric records parsed from foreign logs (verl console lines, HF Trainer / TRL dicts) and
the non-finite evidence drawn from them: each bad line is evidence once, in every form the log
parser recognised before the records existed. Run: `pytest tests/test_logparse.py`."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from verlaudit.analysis.diagnose import diagnose_path
from verlaudit.analysis.logparse import parse_metric_lines

_HEALTHY = "{'loss': 0.6931, 'grad_norm': 1.2, 'learning_rate': 5e-07, 'epoch': 0.01}\n"

# Every shape of HF Trainer / TRL dict line the older `{'loss': ...}` scan caught, as line 2 of a log
# whose line 1 is healthy: the second record, so step 2, with the keys named in the evidence.
HF_NAN_LINES = {
    "unquoted": ("{'loss': nan, 'grad_norm': nan, 'learning_rate': 1e-06, 'epoch': 0.02}", "loss, grad_norm"),
    "quoted (transformers 5)": ("{'loss': 'nan', 'grad_norm': 'nan', 'epoch': '0.4'}", "loss, grad_norm"),
    "inf loss": ("{'loss': inf, 'grad_norm': 3.1}", "loss"),
    "-inf loss": ("{'loss': -inf, 'grad_norm': 3.1}", "loss"),
    "loss only": ("{'loss': nan}", "loss"),
    "after a tqdm bar": (
        " 20%|██        | 2/10 [00:02<00:08,  1.01s/it]{'loss': nan, 'grad_norm': 2.0}",
        "loss",
    ),
    "after a logger prefix": ("[rank0]: {'loss': nan, 'grad_norm': 2.0, 'epoch': 0.02}", "loss"),
    "before a tqdm tail": (
        "{'loss': nan, 'grad_norm': nan, 'epoch': 0.02}   20%|██  | 2/10",
        "loss, grad_norm",
    ),
    "cut off (process killed mid-print)": ("{'loss': nan, 'grad_norm': 1.5, 'learning_ra", "loss"),
    "tensor values (older Trainer)": ("{'loss': tensor(nan, device='cuda:0'), 'grad_norm': 1.0}", "loss"),
}


@pytest.mark.parametrize("line, bad", HF_NAN_LINES.values(), ids=HF_NAN_LINES.keys())
def test_hf_dict_nan_is_one_piece_of_evidence(tmp_path, line, bad):
    log = tmp_path / "trl.log"
    log.write_text(_HEALTHY + line)
    top = diagnose_path(log)[0].causes[0]
    assert top.kind == "nonfinite" and top.step == 2
    on_line = [e for e in top.evidence if e.startswith("line 2:")]
    assert on_line == [f"line 2: step 2: first non-finite metrics {bad}"]


def test_records_from_prefixed_and_cut_off_dicts_keep_their_numbers():
    text = "[rank0]: {'loss': 0.5, 'grad_norm': 2.0}\n{'loss': tensor(0.25, device='cuda:0'), 'grad_no"
    recs = parse_metric_lines(text)
    assert [(r["step"], r["_line"], r["_source"]) for r in recs] == [(1, 1, "hf"), (2, 2, "hf")]
    assert recs[0]["loss"] == 0.5 and recs[0]["grad_norm"] == 2.0
    assert recs[1]["loss"] == 0.25 and "grad_no" not in recs[1]


def test_finite_tensor_values_are_not_taken_for_nan(tmp_path):
    # the old scan read `tensor(0.6931` as not-a-number, i.e. NaN: a clean log reported as diverged
    log = tmp_path / "old_trainer.log"
    log.write_text("{'loss': tensor(0.6931, device='cuda:0'), 'grad_norm': 1.0}\n")
    (d,) = diagnose_path(log)
    assert d.verdict == "clean" and d.causes == []


def test_verl_line_nan_is_one_piece_of_evidence(tmp_path):
    # `actor/pg_loss:nan` is also a plain `loss: nan` to the fallback scan; the record already says it
    log = tmp_path / "verl.log"
    log.write_text("step:1 - actor/pg_loss:-0.013 - critic/vf_loss:0.52\nstep:2 - actor/pg_loss:nan\n")
    top = diagnose_path(log)[0].causes[0]
    assert top.kind == "nonfinite" and top.step == 2
    assert [e for e in top.evidence if e.startswith("line 2:")] == [
        "line 2: step 2: first non-finite metrics actor/pg_loss"
    ]


@pytest.mark.parametrize("line", ["epoch 3 iter 40 loss=nan lr=1e-5", "iter 40 | grad_norm: inf"])
def test_plain_nan_outside_records_is_still_evidence(tmp_path, line):
    log = tmp_path / "plain.log"
    log.write_text(f"epoch 1 done\n{line}\n")
    top = diagnose_path(log)[0].causes[0]
    assert top.kind == "nonfinite" and top.evidence == [f"line 2: log: {line}"]


@given(
    values=st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=1, max_size=4),
    quoted=st.booleans(),
)
def test_hf_record_values_round_trip(values, quoted):
    keys = ["loss", "grad_norm", "learning_rate", "epoch"][: len(values)]
    q = "'" if quoted else ""
    line = "{" + ", ".join(f"'{k}': {q}{v!r}{q}" for k, v in zip(keys, values)) + "}"
    (rec,) = parse_metric_lines(line)
    assert [rec[k] for k in keys] == values
    assert all(math.isfinite(rec[k]) for k in keys)
