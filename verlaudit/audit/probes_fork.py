"""A reward function probed without touching the run: its calls made in a forked copy of the process.

A reward function's contract: the reward of a row is a function of that row only (its prompt, response
and example), the same wherever the row sits in the batch and however large the batch is; the call does
not change its inputs; a correct answer scores above a wrong one. Re-calling a user's function in the
run's process may change its state (a counter, a running statistic, a cache), so every probe call here
runs in a child made by ``os.fork`` (`in_fork`): the child starts from the state the real call starts
from, computes, writes its result to a pipe and ``os._exit``\\ s; a timeout kills it. Whatever the function
keeps, the run never sees the probe's calls. Any failure in the child (an exception, CUDA refusing a
forked process, a timeout, no ``os.fork`` on this platform) skips the probe; it never fails the run.

The probes (`precompute_contract` forks them before the real call, `judge_contract` compares), each compared with the real call's rewards:

- repeat: the same batch twice in one child. The first call reproduces the real one (same state, same
  random state); a second that differs is a reward that keeps state or draws random numbers
  (``reward/not_repeatable``; which of the two is said from whether the call moved python's, numpy's or
  torch's random state);
- permutation: rows shuffled within their GRPO groups and the groups shuffled as blocks (a correct
  group-relative reward stays correct under both); each row's reward must follow its row
  (``reward/follows_position``);
- batch independence: the batch in two halves (on group boundaries), each half in its own child: the
  same rows must get the same rewards (``reward/batch_size_dependent``: a normaliser over the batch or
  over the run's history, a batch limit, a reshape that assumes a size);
- inputs unchanged (passive, on the real call: `ExampleSnapshot`): the examples' keys and values before
  and after the call (``reward/mutates_examples``: a popped answer, a rewritten field).

The answer probe (`verlaudit.audit.probes_answer`) uses the same fork. Run once per run (the first
audited step the reward function is called on; ``audit.probe_plugins: false`` turns it off). Exercised
by `pytest tests/test_probes_fork.py`.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import pickle
import random
import select
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from verlaudit import kinds as K
from verlaudit.rundir import Finding

TIMEOUT_S = 10.0
"""Seconds a probe child may take before it is killed (the probe is then skipped, and every later probe
of the process with it: a child that hangs on a lock another thread held at the fork hangs again)."""
_STOPPED: list[str] = []
"""Why the probes stopped for this process (a child timed out), once."""
REL_TOL = 2e-2
"""A reward moved when it differs by more than this fraction of the real rewards' scale (the largest
|reward|): a normaliser, a limit, a mixed group or a cache moves rewards by a large share of their
scale (a third and more in the faults we know); a batched computation run on another batch size moves
them by its dtype's rounding, at most a few ulps of the scale (bf16: 2^-8 = 0.4% an ulp)."""
MIN_MOVED = 1
"""Rows whose reward moved before a probe is a finding (one is enough: a correct reward moves none)."""


def can_fork() -> bool:
    return hasattr(os, "fork") and os.name == "posix"


def in_fork(fn: Callable[[], Any], *, timeout: float = TIMEOUT_S) -> tuple[bool, Any]:
    """``(True, fn())`` computed in a forked child, or ``(False, why)``: no fork on this platform, the
    child raised, died, timed out or returned something that cannot be pickled. The parent's state is
    untouched by whatever ``fn`` does."""
    if not can_fork():
        return False, "os.fork is not available on this platform"
    if _STOPPED:
        return False, _STOPPED[0]
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError as e:
        os.close(r)
        os.close(w)
        return False, f"fork failed: {e}"
    if pid == 0:  # the child: compute, write, leave without running the parent's atexit handlers
        code = 0
        try:
            os.close(r)
            try:
                import torch

                torch.set_num_threads(1)  # an OpenMP pool does not survive fork
            except Exception:
                pass
            try:
                payload = pickle.dumps((True, fn()))
            except BaseException as e:  # noqa: BLE001 -- anything the user's code raises is a skipped probe
                payload = pickle.dumps((False, f"{type(e).__name__}: {e}"[:300]))
            view = memoryview(payload)
            while view:
                n = os.write(w, view)
                view = view[n:]
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    chunks, deadline, ok = [], time.monotonic() + timeout, True
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                ok = False
                break
            ready, _, _ = select.select([r], [], [], left)
            if not ready:
                continue
            data = os.read(r, 1 << 16)
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(r)
        if not ok:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.waitpid(pid, 0)
        except OSError:
            pass
    if not ok:
        _STOPPED.append(f"a probe took longer than {timeout:g} s: the reward probes stopped for this run")
        return False, f"the probe took longer than {timeout:g} s"
    try:
        done, value = pickle.loads(b"".join(chunks))
    except Exception:
        return False, "the probe's child died before it answered"
    return (True, value) if done else (False, value)


def scores(raw: Any, n: int | None = None) -> list[float] | None:
    """One float per row from what a reward function returned (a list of numbers or verl's score dicts, a
    numpy array, a tensor); None when it is not that, or not ``n`` long."""
    if hasattr(raw, "detach"):
        raw = raw.detach().cpu().double().flatten().tolist()
    elif hasattr(raw, "tolist") and hasattr(raw, "dtype"):
        raw = raw.tolist()
    if not isinstance(raw, (list, tuple)):
        return None
    out = []
    for v in raw:
        v = v.get("score") if isinstance(v, Mapping) else v
        if hasattr(v, "item") and not isinstance(v, numbers.Number):
            try:
                v = v.item()
            except Exception:
                return None
        if not isinstance(v, numbers.Real) or isinstance(v, bool):
            return None
        out.append(float(v))
    return out if n is None or len(out) == n else None


def _rng_state() -> tuple:
    state: list[Any] = [random.getstate()]
    try:
        import numpy as np

        state.append(np.random.get_state()[1].tobytes())
    except Exception:
        state.append(None)
    try:
        import torch

        state.append(torch.get_rng_state().numpy().tobytes())
    except Exception:
        state.append(None)
    return tuple(state)


def bound_inputs(call: Any) -> tuple[Callable, list, list, list] | None:
    """``(fn, prompts, responses, examples)`` of a reward function's call as the trainer binds it
    (``functools.partial(reward_fn, prompts, responses, examples)``), else None (the probe is skipped)."""
    if not isinstance(call, functools.partial) or call.keywords or len(call.args) != 3:
        return None
    prompts, responses, examples = call.args
    if not all(isinstance(x, (list, tuple)) for x in (prompts, responses, examples)):
        return None
    if not (len(prompts) == len(responses) == len(examples)) or len(responses) < 2:
        return None
    return call.func, list(prompts), list(responses), list(examples)


def groups_of(examples: Sequence[Any], group_size: int) -> list[list[int]]:
    """Row indices by GRPO group (consecutive rows of ``group_size``), else one row a group."""
    n = len(examples)
    g = group_size if group_size >= 2 and n % group_size == 0 else 1
    return [list(range(i, i + g)) for i in range(0, n, g)]


def _moved(a: Sequence[float], b: Sequence[float], scale: float) -> list[int]:
    tol = REL_TOL * max(scale, 1e-12)
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        if math.isnan(x) and math.isnan(y):
            continue
        if not (abs(x - y) <= tol):
            out.append(i)
    return out


class ExampleSnapshot:
    """The examples' keys and values (their reprs, shallow) before the real call, compared after it: a
    reward function that pops or rewrites a field takes it from every later use of the example (the
    other responses of its GRPO group, the next epoch)."""

    def __init__(self, examples: Sequence[Any]) -> None:
        self.before: dict[int, tuple[Any, dict[str, str]]] = {}
        for ex in examples:
            if isinstance(ex, dict) and id(ex) not in self.before:
                self.before[id(ex)] = (ex, {str(k): _short_repr(v) for k, v in ex.items()})

    def changes(self) -> dict[str, Any] | None:
        removed: dict[str, int] = {}
        changed: dict[str, int] = {}
        added: dict[str, int] = {}
        for ex, keys in self.before.values():
            now = {str(k): _short_repr(v) for k, v in ex.items()}
            for k, v in keys.items():
                if k not in now:
                    removed[k] = removed.get(k, 0) + 1
                elif now[k] != v:
                    changed[k] = changed.get(k, 0) + 1
            for k in now.keys() - keys.keys():
                added[k] = added.get(k, 0) + 1
        if not (removed or changed):  # a key added (a cache) leaves what the others read
            return None
        return {"removed": removed, "changed": changed, "added": added, "examples": len(self.before)}


def _short_repr(v: Any) -> str:
    try:
        return repr(v)[:200]
    except Exception:
        return f"<{type(v).__name__}>"


def mutation_finding(
    change: Mapping[str, Any], *, source: str, fn_name: str, ctx: Mapping[str, Any]
) -> Finding:
    removed, changed = change["removed"], change["changed"]
    what = "; ".join(
        [f"removed key {k!r} from {n} of {change['examples']} examples" for k, n in removed.items()]
        + [f"rewrote key {k!r} in {n} of {change['examples']} examples" for k, n in changed.items()]
    )
    keys = ", ".join(repr(k) for k in [*removed, *changed])
    return Finding(
        severity="error",
        kind=K.REWARD_MUTATES_EXAMPLES,
        role="reward",
        where=f"reward:{source}",
        message=f"the reward function {fn_name} modified its inputs in place: it {what}; the examples are "
        "the dataset's own objects (GRPO hands one example to every response of its group), so the "
        "group's other responses, the second reward call and later epochs see the example without it",
        observed=dict(change),
        expected="the examples unchanged by the reward call",
        fix=f"read the example's fields without changing it (ex.get({keys.split(', ')[0]}) instead of "
        f"ex.pop(...), no assignment into the example); copy it first (dict(ex)) where the reward needs "
        "a changed version",
        **ctx,
    )


def _call(fn: Callable, prompts, responses, examples) -> list[float] | None:
    return scores(fn(list(prompts), list(responses), list(examples)), len(responses))


def _take(rows: Sequence[int], *lists: Sequence[Any]) -> list[list[Any]]:
    return [[xs[i] for i in rows] for xs in lists]


def _permutation(groups: list[list[int]], seed: int) -> list[int]:
    """The groups shuffled as blocks and each group's rows shuffled within it."""
    rng = random.Random(seed)
    order = list(range(len(groups)))
    rng.shuffle(order)
    perm: list[int] = []
    for gi in order:
        rows = list(groups[gi])
        rng.shuffle(rows)
        perm.extend(rows)
    return perm


def precompute_contract(
    fn: Callable, prompts: list, responses: list, examples: list, *, group_size: int, seed: int = 0
) -> dict[str, Any]:
    """The probe calls of one batch, each in a child forked now (before the real call): the batch twice,
    the batch reordered, its two halves, its groups one at a time. Nothing here reads the real call."""
    n = len(responses)
    out: dict[str, Any] = {"n": n}

    def repeat() -> tuple[list[float] | None, list[float] | None, bool]:
        a = _call(fn, prompts, responses, examples)
        before = _rng_state()
        b = _call(fn, prompts, responses, examples)
        return a, b, _rng_state() != before

    out["repeat"] = in_fork(repeat)
    groups = groups_of(examples, group_size)
    out["group"] = len(groups[0])
    perm = _permutation(groups, seed)
    if perm != list(range(n)):
        p, r, e = _take(perm, prompts, responses, examples)
        out["perm"] = (perm, in_fork(lambda: _call(fn, p, r, e)))
    if len(groups) >= 2:
        half = len(groups) // 2
        halves = [[i for g in groups[:half] for i in g], [i for g in groups[half:] for i in g]]
        got_all: dict[int, float] = {}
        for rows in halves:  # each half in its own child: both start from the real call's state
            p, r, e = _take(rows, prompts, responses, examples)
            ok, got = in_fork(lambda p=p, r=r, e=e: _call(fn, p, r, e))
            if ok and got is not None:
                got_all.update(zip(rows, got))
        out["halves"] = got_all

        def one_by_one() -> list[float | None]:
            vals: list[float | None] = [None] * n
            for rows in groups:
                p, r, e = _take(rows, prompts, responses, examples)
                got = _call(fn, p, r, e)
                if got is not None:
                    for i, v in zip(rows, got):
                        vals[i] = v
            return vals

        ok, singles = in_fork(one_by_one)
        if ok:
            out["singles"] = {i: v for i, v in enumerate(singles) if v is not None}
    return out


# long: three probes' verdicts in their order of precedence (repeat, then order, then batch size), each a worded finding
def judge_contract(
    pre: Mapping[str, Any], real: list[float], *, source: str, fn_name: str, ctx: Mapping[str, Any]
) -> tuple[list[Finding], dict[str, Any]]:
    """`precompute_contract`'s answers against the real call's rewards ``real``; (findings, what ran)."""
    n = len(real)
    scale = max((abs(x) for x in real if math.isfinite(x)), default=0.0)
    ran: dict[str, Any] = {}
    out: list[Finding] = []
    where = f"reward:{source}"
    ok, got = pre["repeat"]
    ran["repeat"] = ok
    if ok and got[0] is not None and got[1] is not None:
        first, second, rng_moved = got
        moved = _moved(first, second, scale)
        if len(moved) >= MIN_MOVED:
            likely = (
                "it draws random numbers (the call moved the random generators' state)"
                if rng_moved
                else "it keeps state between calls (a counter, a running statistic, a cache in the module)"
            )
            out.append(
                Finding(
                    severity="error",
                    kind=K.REWARD_NOT_REPEATABLE,
                    role="reward",
                    where=where,
                    message=f"the reward function {fn_name} scores the same batch differently when it is called "
                    f"twice: {len(moved)} of {n} rows got another reward the second time "
                    f"({_pairs(first, second, moved)}); likely {likely}, so a response's reward is not a "
                    "function of the response",
                    observed={"rows_moved": len(moved), "rows": n, "random_state_moved": rng_moved},
                    expected="the same rewards for the same batch",
                    fix=(
                        "seed the reward's randomness from the row (hash of prompt and response) or remove it"
                        if rng_moved
                        else "make the reward a function of the row only: no module-level state (running max / "
                        "mean, call counters, caches that change the score); normalise with fixed constants"
                    ),
                    **ctx,
                )
            )
            return out, ran  # a reward that cannot repeat itself moves under every other probe too
    if "perm" in pre:
        perm, (ok, got) = pre["perm"]
        ran["permutation"] = ok
        if ok and got is not None:
            expected = [real[i] for i in perm]
            moved = _moved(got, expected, scale)
            if len(moved) >= MIN_MOVED:
                shape, fix = _order_shape(real, got, pre["group"])
                out.append(
                    Finding(
                        severity="error",
                        kind=K.REWARD_FOLLOWS_POSITION,
                        role="reward",
                        where=where,
                        message=f"the reward function {fn_name} gives a row another reward when the batch's rows "
                        f"are reordered (each group's responses shuffled, the groups moved as blocks): "
                        f"{len(moved)} of {n} rows' rewards did not follow their row "
                        f"({_pairs(expected, got, moved, perm)}): a row's reward depends on its position or on "
                        f"the rows beside it ({shape})",
                        observed={"rows_moved": len(moved), "rows": n, "group_size": pre["group"]},
                        expected="each row's reward follows its row under any reordering",
                        fix=fix,
                        **ctx,
                    )
                )
    cases = []
    if pre.get("halves"):
        cases.append(("in two halves", pre["halves"]))
    if pre.get("singles"):
        cases.append(("one group at a time" if pre["group"] > 1 else "one row at a time", pre["singles"]))
    ran["sub_batches"] = [how for how, _ in cases]
    for how, seen in cases:
        if any(f.kind in (K.REWARD_FOLLOWS_POSITION, K.REWARD_BATCH_SIZE) for f in out):
            break
        rows = sorted(seen)
        exp, got = [real[i] for i in rows], [seen[i] for i in rows]
        idx = _moved(got, exp, scale)
        if len(idx) < MIN_MOVED:
            continue
        out.append(
            Finding(
                severity="error",
                kind=K.REWARD_BATCH_SIZE,
                role="reward",
                where=where,
                message=f"the reward function {fn_name} scores the same rows differently in a smaller batch: "
                f"the batch of {n} scored {how} gave {len(idx)} of {len(rows)} rows another reward "
                f"({_pairs(exp, got, idx, rows)}): the reward depends on the batch it arrives in (a "
                "normaliser over the batch or the run's history, a limit on the rows a request scores, a "
                "reshape that assumes a size)",
                observed={"rows_moved": len(idx), "rows": len(rows), "scored": how},
                expected="each row's reward the same in any batch",
                fix="score each row on its own: no normalisation by the batch's or the run's scores (a "
                "running max / mean), no request limit that leaves rows unscored (send the batch in "
                "chunks the scorer accepts), no reshape to a fixed batch size",
                **ctx,
            )
        )
    return out, ran


CONTRACT_KINDS = (K.REWARD_NOT_REPEATABLE, K.REWARD_FOLLOWS_POSITION, K.REWARD_BATCH_SIZE)
"""The kinds after which the answer probe is not read (the reward does not follow its rows)."""


def _order_shape(real: Sequence[float], got: Sequence[float], group: int) -> tuple[str, str]:
    """What the reordered call's rewards look like, and the fix that goes with it: one value per group (the
    group's first row's: a cache keyed on the prompt), returned sorted (both calls' rewards in ascending or
    descending order), else a layout or an index into the batch."""

    def monotone(x: Sequence[float]) -> bool:
        return all(a <= b for a, b in zip(x, x[1:])) or all(a >= b for a, b in zip(x, x[1:]))

    if group > 1:
        blocks = [got[i : i + group] for i in range(0, len(got), group)]
        real_blocks = [real[i : i + group] for i in range(0, len(real), group)]
        if all(len(set(b)) == 1 for b in blocks) and all(len(set(b)) == 1 for b in real_blocks):
            return (
                "every response of a group gets one reward, the group's first row's in either order: a "
                "score cached by the prompt (or by the example) and reused for the group's other responses",
                "key any cache of scores by the response as well as the prompt (or drop the cache): a memo "
                "keyed on the prompt alone gives every later response to it the first response's score",
            )
    if len(real) > 2 and monotone(real) and monotone(got) and len(set(real)) > 1:
        return (
            "the rewards come back sorted, in both orders of the rows: the scores are returned after a sort, "
            "not in the responses' order",
            "return the scores in the rows' order: keep the batch's order through any clip / winsorise "
            "(np.clip on the scores, not np.sort), or unsort with the argsort's inverse",
        )
    return (
        "a reshape of the batch into another layout than [prompts, group], an index into the batch",
        "compute each row's reward from its own prompt, response and example; group the batch as [prompts, "
        "group] (reshape(-1, group_size), the group's rows consecutive) where a group statistic is meant",
    )


def _pairs(
    a: Sequence[float], b: Sequence[float], idx: Sequence[int], names: Sequence[int] | None = None, k: int = 3
) -> str:
    """``row i: real -> probe`` for the first ``k`` of ``idx`` (positions in ``a``/``b``; ``names`` the rows)."""
    label = names if names is not None else range(len(a))
    return ", ".join(f"row {label[i]}: {a[i]:.4g} -> {b[i]:.4g}" for i in idx[:k]) + (
        " ..." if len(idx) > k else ""
    )
