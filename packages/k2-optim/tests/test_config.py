"""k2-optim's config components: the WSD phases a run's schedule is built from, and the optimizer
fields' checks (named by field, as the `k2` commands report them)."""

from __future__ import annotations

import math

import pytest
import torch
from k2_optim import MuonClip, OptimConfig, WSDConfig, wsd_schedule
from k2_optim.config import TASK_QK_CLIP_TAU


def test_wsd_phases_span_and_factors():
    s = WSDConfig(warmup_steps=10, decay_fraction=0.2, schedule_steps=0, min_lr_ratio=0.1)
    assert s.span(200) == 200 and WSDConfig(schedule_steps=50).span(200) == 50
    assert s.phases(200) == (10, 150, 40)
    assert s.phases(5) == (5, 0, 0)  # warmup longer than the run: all warmup, no decay
    f = s.lr_factors(200, 200)
    assert f[0] == pytest.approx(0.1) and f[9] == 1.0 and f[159] == 1.0
    assert f[160] == 1.0  # the cosine starts at the peak
    assert f[199] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 39 / 40)))
    # the factors are the scheduler's: the same numbers stepping a real optimizer
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = wsd_schedule(opt, *s.phases(200), s.min_lr_ratio)
    seen = []
    for _ in range(200):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx(f)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("lr", 0.0, "lr=0.0: expected > 0"), ("tau", -1.0, "tau=-1.0: expected > 0"),
     ("optimizer", "sgd", "optimizer='sgd': expected one of muonclip, muon, adamw"),
     ("ns_dtype", "fp16", "ns_dtype='fp16'")],
)  # fmt: skip
def test_optim_config_names_a_bad_field(field, value, message):
    with pytest.raises(ValueError, match=f"^run config: {message}"):
        OptimConfig(**{field: value}).validate("run config")
    with pytest.raises(ValueError, match="decay_fraction=1.5"):
        WSDConfig(decay_fraction=1.5).validate("run config")


def test_task_tau_is_the_small_scale_value_and_muonclip_keeps_k2s():
    import inspect

    assert OptimConfig().tau == TASK_QK_CLIP_TAU == 30.0
    assert inspect.signature(MuonClip).parameters["tau"].default == 100.0
