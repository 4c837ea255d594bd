"""What a collator returned, checked on every batch (not only the sampled steps the plug-in recorder of
`verlaudit.audit.plugins` watches): its token ids' rank. A collator that stacks per-example ``[1, P]``
tokenizer outputs (``torch.stack``) returns ``[B, 1, P]``; the run then fails in the rollout's ``generate`` with an
error that names the engine, and this finding (class ``batch_shape``) is the root diagnose puts before it.
Exercised by `pytest tests/test_plugin_wrap_and_rank.py`.
"""

from __future__ import annotations

from typing import Any

import torch

from verlaudit import kinds as K
from verlaudit.rundir import Finding


def batch_rank_findings(
    batch: Any, *, role: str, source: str, step: int | None = None, phase: str | None = None
) -> list[Finding]:
    """Token ids of another rank than [batch, length]: ``torch.stack`` of per-example ``[1, P]``
    tokenizer outputs makes ``[B, 1, P]``, which the rollout's ``generate`` and the model's embedding
    take as another layout or refuse later (the exception then names the engine, not the collator).
    Checked on every batch, whatever the step: it reads shapes only."""
    if not hasattr(batch, "items"):
        return []
    out = []
    for k, v in batch.items():
        if (
            not (isinstance(k, str) and k.endswith("input_ids") and isinstance(v, torch.Tensor))
            or v.dim() == 2
        ):
            continue
        shape = list(v.shape)
        ones = [i for i, n in enumerate(shape) if n == 1 and i > 0]
        hint = (
            f"torch.cat the per-example [1, length] tensors (or .squeeze({ones[0]})) instead of torch.stack"
            if v.dim() == 3 and ones
            else "return [batch, length] tensors"
        )
        out.append(
            Finding(
                severity="error",
                kind=K.COLLATOR_RANK,
                message=f"the collator ({source}) returned {k} of shape {shape} ({v.dim()}-D): the rollout and the "
                f"model take [batch, length] (2-D); the batch has an extra dimension",
                role=role,
                where=f"collator:{source}.{k}",
                observed={"shape": shape, "ndim": v.dim()},
                expected="[batch, length]",
                fix=f"in the collator: {hint}, so that every ids and mask field has shape [batch, length]",
                step=step,
                phase=phase,
            )
        )
        break
    return out
