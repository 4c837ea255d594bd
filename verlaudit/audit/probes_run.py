"""When the reward function's contract probes run, and what they record (the `Auditor`'s side).

`RewardProbe.before` is called with the reward function's call as the trainer binds it, before the real
call: it snapshots the examples (`probes_fork.ExampleSnapshot`) and, on the first `PROBE_CALLS` audited
calls of the run, keeps the inputs. `RewardProbe.after` takes the real call's result: the inputs
compared with the snapshot, then the forked probes' answers judged against the real rewards
(`probes_fork.judge_contract`, `probes_answer.judge_answers`). The children are forked and awaited in
`before` (`probes_fork.precompute_contract`, `probes_answer.precompute_answers`), so each starts from
the state the real call starts from; only their comparison waits for the real call. Without ``os.fork``
the probes are skipped and the run's events say so once (``probe_skipped``); their cost is written as an
event (``reward_probe`` with ``seconds``). The examples' snapshot is taken on every audited call.
``audit.probe_plugins: false`` turns them off. Exercised by `pytest tests/test_probes_fork.py`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from verlaudit.audit import probes_answer, probes_fork, reward_grid
from verlaudit.audit.invariants_data import _data_source
from verlaudit.rundir import Finding

PROBE_CALLS = 2
"""Audited reward-function calls of a run that are probed (the first ones: a running normaliser or a
batch limit shows at the start, when the run's history is short)."""


class RewardProbe:
    """The reward function's contract, probed on the first audited calls of a run."""

    def __init__(self, *, enabled: bool = True, calls: int = PROBE_CALLS) -> None:
        self.enabled = enabled
        self.calls = calls
        self.done = 0
        self.said_skip = False
        self.events: list[tuple[str, dict[str, Any]]] = []
        """(kind, data) for the run's events.jsonl: the probes' cost, a skip said once."""

    def before(
        self,
        call: Any,
        *,
        source: str,
        data: Mapping[str, Any] | None,
        group_size: int,
        ctx: Mapping[str, Any],
    ) -> Callable[[Any], list[Finding]] | None:
        """Called before the real call; returns what to call with its result (None: nothing to probe)."""
        if not self.enabled:
            return None
        bound = probes_fork.bound_inputs(call)
        if bound is None:
            return None
        fn, prompts, responses, examples = bound
        snapshot = probes_fork.ExampleSnapshot(examples)
        probe = self.done < self.calls
        if probe and not probes_fork.can_fork():
            probe = False
            if not self.said_skip:
                self.said_skip = True
                self.events.append(
                    ("probe_skipped", {"why": "os.fork is not available: reward probes skipped"})
                )
        if probe:
            self.done += 1
        fn_name = source.removeprefix("function:").removeprefix("verl:")
        plan = None
        t0 = time.perf_counter()
        if probe:  # the children fork now, from the state the real call starts from
            plan = _Plan(
                fn, prompts, responses, examples, group_size, source, fn_name, _data_source(data), ctx
            )
            plan.fork_all()
        spent = time.perf_counter() - t0

        def after(result: Any) -> list[Finding]:
            out: list[Finding] = []
            change = snapshot.changes()
            if change is not None:
                out.append(probes_fork.mutation_finding(change, source=source, fn_name=fn_name, ctx=ctx))
            if plan is None:
                return out
            real = probes_fork.scores(result, len(responses))
            if real is not None and change is None:  # a mutating reward is explained by the mutation
                out += plan.findings(real)
            self.events.append(("reward_probe", {"seconds": round(spent, 4), **plan.ran, **ctx}))
            return out

        return after


class _Plan:
    """The probe children of one call, forked before the real call; compared after it.

    Each variant runs in its own child at `fork_all` (`probes_fork.in_fork` waits for it there, before the
    real call starts), so every child starts from the state the real call starts from."""

    def __init__(self, fn, prompts, responses, examples, group_size, source, fn_name, data_key, ctx) -> None:
        self.args = (fn, prompts, responses, examples)
        self.group_size, self.source, self.fn_name, self.data_key, self.ctx = (
            group_size,
            source,
            fn_name,
            data_key,
            ctx,
        )
        self.ran: dict[str, Any] = {}

    def fork_all(self) -> None:
        fn, prompts, responses, examples = self.args
        # the variants' scores do not depend on the real call's result: compute them now, compare later
        self._contract = probes_fork.precompute_contract(
            fn, prompts, responses, examples, group_size=self.group_size
        )
        self._answer = probes_answer.precompute_answers(fn, prompts, examples, group_size=self.group_size)

    def findings(self, real: list[float]) -> list[Finding]:
        found, ran = probes_fork.judge_contract(
            self._contract, real, source=self.source, fn_name=self.fn_name, ctx=self.ctx
        )
        self.ran.update(ran)
        if any(f.kind in probes_fork.CONTRACT_KINDS for f in found):
            return found  # a reward that does not follow its rows scores the probe's rows as it pleases
        more, ran = probes_answer.judge_answers(
            self._answer, real, source=self.source, fn_name=self.fn_name, data_key=self.data_key, ctx=self.ctx
        )
        self.ran.update(ran)
        return found + reward_grid.lenient_hint(more, self.args[0])  # prec13: the line that rounds, named
