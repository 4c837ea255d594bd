"""Weights a coarse grid zeroed (verlaudit/audit/resolution.py): an int8 absmax quantisation whose scale
an outlier set is found and named with the key that loaded the model; float weights, a quantisation
whose step fits the weights, pruned float weights and all-zero tensors are not."""

from __future__ import annotations

import torch
from torch import nn

from verlaudit import kinds as K
from verlaudit.audit.resolution import source_key, weight_grid


def _int8(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().max() / 127.0
    return (w / scale).round().clamp(-127, 127) * scale


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 1))


def test_float_and_well_scaled_int8_weights_are_quiet():
    m = _model()
    assert weight_grid("reward", m) == []
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(_int8(p))
    assert weight_grid("reward", m) == []  # the step fits the weights: most stay nonzero


def test_an_outlier_scale_that_zeroes_a_head_is_an_error_naming_the_loader():
    m = _model()
    with torch.no_grad():
        head = m[1].weight
        head.mul_(0.05)
        head.view(-1)[7] = 40.0
        for p in m.parameters():
            if p.ndim == 2:
                p.copy_(_int8(p))
    (f,) = weight_grid("reward", m, "model.reward_model (rm.py:load)")
    assert f.kind == K.PRECISION_WEIGHT_GRID and f.severity == "error"
    assert f.where == "model.reward_model (rm.py:load)" and f.observed["tensor"] == "1.weight"
    assert f.observed["zero_share"] > 0.9 and "per channel" in f.fix


def test_pruned_float_weights_and_zero_tensors_are_not_a_grid():
    m = _model()
    with torch.no_grad():
        w = m[0].weight
        w.view(-1)[::4] = 0.0
        w.view(-1)[1::4] = 0.0
        w.view(-1)[2::4] = 0.0  # 75% zeros, the rest float
        m[1].weight.zero_()
    assert weight_grid("actor", m) == []


def test_the_source_key_of_each_role():
    cfg = {"model": {"reward_model": "rm.py:load", "path": "/ckpt"}}
    assert source_key(cfg, "reward") == "model.reward_model (rm.py:load)"
    assert source_key(cfg, "actor") == "model.path (/ckpt)" and source_key(cfg, "critic") is None
