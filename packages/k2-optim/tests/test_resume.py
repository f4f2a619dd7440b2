"""state_dict / load_state_dict: a resumed MuonClip + WSD run takes the same next step, bit for bit."""

import io

import torch
from k2_optim import MuonClip, wsd_schedule
from k2_optim.testing import loud_mla_model


def _build(seed=5):
    model = loud_mla_model(seed=seed, gain=6.0)
    opt = MuonClip(
        model, lr=3e-2, weight_decay=0.1, tau=8.0, ns_coefficients="polar_express", ns_dtype=torch.float32
    )
    sched = wsd_schedule(opt, warmup_steps=2, stable_steps=1, decay_steps=4, min_lr_ratio=0.1)
    return model, opt, sched


def _train_step(model, opt, sched, step):
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(100 + step))
    opt.zero_grad()
    logits = model(ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    opt.step()
    sched.step()


def test_resume_is_bit_exact():
    model, opt, sched = _build()
    model.train()
    for step in range(3):
        _train_step(model, opt, sched, step)
    assert opt.last_clip_stats()["fraction_ever_clipped"] > 0  # the clip state is part of what resumes
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    for step in range(3, 5):
        _train_step(model, opt, sched, step)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_frac = opt.last_clip_stats()["fraction_ever_clipped"]

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model2, opt2, sched2 = _build(seed=99)  # different init: everything must come from the checkpoint
    model2.train()
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    for step in range(3, 5):
        _train_step(model2, opt2, sched2, step)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert opt2.last_clip_stats()["fraction_ever_clipped"] == expected_frac
