"""Finding kinds of the token contract (tok13): the tokens the loss weights and the policy conditions on are
the tokens the dataset and the sampler say, in full and in place (`verlaudit.audit.truncation`,
`verlaudit.integrations.loop_text`, `loop_weights`). Registered here, re-exported by `verlaudit.kinds`
(write them as ``K.NAME``); split out of kinds.py for length."""

from __future__ import annotations

from verlaudit.kind_registry import _f

PAIR_EOS_CUT = _f(
    "data/pair_eos_cut",
    "truncation",
    "one side of most DPO pairs cut before its eos at the response length, the other side ending with it",
)
