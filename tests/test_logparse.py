"""Per-step metric records parsed from foreign logs (verl console lines, HF Trainer / TRL dicts) and
the non-finite evidence drawn from them: each bad line is evidence once, in every form the log
parser recognised before the records existed. Run: `pytest tests/test_logparse.py`."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from verlaudit.analysis.diagnose.diagnosis import diagnose_path
from verlaudit.analysis.logs.records import parse_metric_lines

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


def test_plain_nan_outside_records_is_still_evidence(tmp_path):
    line = "iter 40 | grad_norm: inf"  # one pair: no record, the plain scan's evidence
    log = tmp_path / "plain.log"
    log.write_text(f"epoch 1 done\n{line}\n")
    top = diagnose_path(log)[0].causes[0]
    assert top.kind == "nonfinite" and top.evidence == [f"line 2: log: {line}"]


def test_key_value_line_is_a_record_with_its_step(tmp_path):
    # two pairs, one a training metric: a key=value record (its step from `iter 40`), one piece of evidence
    log = tmp_path / "plain.log"
    log.write_text("epoch 1 done\nepoch 3 iter 40 loss=nan lr=1e-5\n")
    top = diagnose_path(log)[0].causes[0]
    assert top.kind == "nonfinite" and top.step == 40
    assert top.evidence == ["line 2: step 40: first non-finite metrics loss"]


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


# ---- a long log is read in one pass with bounded memory, and diagnosed as its short self ----------

SMALL = """\
step:1 - actor/pg_loss:-0.013 - critic/vf_loss:0.52
step:2 - actor/pg_loss:0.010 - critic/vf_loss:nan
Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0
Traceback (most recent call last):
  File "/opt/verl/verl/workers/fsdp_workers.py", line 612, in update_actor
    metrics = self.actor.update_policy(data=data)
  File "/usr/lib/python3/site-packages/torch/nn/modules/linear.py", line 125, in forward
RuntimeError: expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16
"""
FILLER = (
    "(WorkerDict pid=1234) INFO rollout: 512 sequences " + "." * 950 + "\n"
)  # 1000 characters, no evidence
_MEASURE = """\
import json, sys
from verlaudit.analysis.diagnose.diagnosis import diagnose_path

def status_mib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024

for path in sys.argv[1:]:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident size (VmHWM) to the current one
    before = status_mib("VmRSS")
    (d,) = diagnose_path(path)
    print(json.dumps({"growth_mib": status_mib("VmHWM") - before, **d.to_dict()}, default=str))
"""


def _shifted(diagnosis: dict, lines: int) -> list:
    """The causes of a diagnosis (as data), their evidence's log line numbers moved by ``lines``."""
    causes = json.loads(json.dumps(diagnosis["causes"], default=str))
    for c in causes:
        if c.get("line") is not None:
            c["line"] += lines
        c["evidence"] = [
            re.sub(r"^line (\d+)|(?<=first at )line (\d+)", lambda m: f"line {int(m[1] or m[2]) + lines}", e)
            for e in c["evidence"]
        ]
    return causes


@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="peak memory is read from Linux's /proc"
)
def test_a_48_mib_log_is_diagnosed_like_its_last_lines_in_bounded_memory(tmp_path):
    small, big, one_line = tmp_path / "small.log", tmp_path / "big.log", tmp_path / "one_line.log"
    small.write_text(SMALL)
    n = 48 * 1024  # filler lines: 48 MiB before the evidence
    with open(big, "w") as f:
        for _ in range(n // 1024):
            f.write(FILLER * 1024)
        f.write(SMALL)
    one_line.write_text("x" * (48 << 20) + "\n" + SMALL)  # a progress bar that never printed a newline
    # the peak resident memory of diagnose in a fresh process, over the memory it started with
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(big), str(one_line)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 0, out.stderr
    got_big, got_one = (json.loads(line) for line in out.stdout.splitlines())
    # reading the file whole (the previous reader) grew the process by about 4 x the file's size
    assert got_big["growth_mib"] < 24 and got_one["growth_mib"] < 24, (
        got_big["growth_mib"],
        got_one["growth_mib"],
    )
    (want,) = diagnose_path(small)
    want = want.to_dict()
    # errors in log order (the NaN at line 2 before the dtype error at line 8), then the info-level skips
    assert [c["kind"] for c in want["causes"]] == ["nonfinite", "dtype_error", "overflow_skips"]
    assert _shifted(want, n) == _shifted(got_big, 0) and _shifted(want, 1) == _shifted(got_one, 0)
    assert (got_big["verdict"], got_big["state"]) == (want["verdict"], want["state"])
    assert f"{n + 8} lines" in got_big["summary"]


def test_a_traceback_and_its_error_line_are_read_together_far_into_a_log(tmp_path):
    # the scan keeps the frames of an open traceback, so the error line that ends it is placed in it
    log = tmp_path / "x.log"
    log.write_text("".join(f"info line {i}\n" for i in range(37)) + SMALL)
    (d,) = diagnose_path(log)
    c = next(c for c in d.causes if c.kind == "dtype_error")
    assert c.evidence[0].startswith("line 45: RuntimeError: expected m1 and m2")
    frame = "raised from /opt/verl/verl/workers/fsdp_workers.py:612 in update_actor: "
    assert c.evidence[1] == frame + "metrics = self.actor.update_policy(data=data)"
    assert c.phase == "update" and c.where == (
        "update_actor: self.actor.update_policy (self.actor.update_policy(data=data), in verl/workers/fsdp_workers.py)"
    )
