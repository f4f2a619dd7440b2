import emu_attn as E
import numpy as np
import torch
from k2_kernels import reference

E.ROUND = True


def run(lens, H, DK, DV, causal, seed=1):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q, k, v, g = (torch.randn(T, H, d, generator=gen).to(torch.bfloat16) for d in (DK, DK, DV, DV))
    cu = [0] + np.cumsum(lens).tolist()
    scale = DK**-0.5

    def ref(dtype):
        leaves = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
        o, l, m = reference.mla_attention(*leaves, torch.tensor(cu), scale, causal)
        o.backward(g.to(dtype))
        return [o.detach(), leaves[0].grad, leaves[1].grad, leaves[2].grad]

    hi, lo = ref(torch.float64), ref(torch.bfloat16)
    qd, kd, vd, gd = (t.double().numpy().ravel() for t in (q, k, v, g))
    o, lse, mx = E.fwd(qd, kd, vd, cu, T, H, DK, DV, scale, causal, max(lens))
    out_t = torch.tensor(o).view(T, H, DV)
    delta = (out_t * g.double()).sum(-1).transpose(0, 1).contiguous().numpy().ravel()
    dq, dk, dv = E.bwd(qd, kd, vd, gd, lse, delta, cu, T, H, DK, DV, scale, causal, max(lens))
    for name, a, h_, l_ in zip(["out", "dq", "dk", "dv"], [o, dq, dk, dv], hi, lo):
        a = torch.tensor(a).view(h_.shape)
        e_k = (a - h_).norm().item()
        e_r = (l_.double() - h_).norm().item()
        print(f"{name}: kernel {e_k:.3e} ref-bf16 {e_r:.3e} ratio {e_k / e_r:.2f}")


run([200], 1, 64, 64, True)
run([150, 40], 2, 32, 32, False)
