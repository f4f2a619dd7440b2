"""Lane-level emulation of the SIMT kernels (fwd_simt_kernel, bwd_simt_kernel) in float64."""

import numpy as np
import torch
from emu_attn import tiles
from k2_kernels import reference

LANE = np.arange(32)
BM = BN = 32
R = BM // 4
KW = BN // 4
MAXC = 8


def fwd(q, k, v, cu, T, H, Dk, Dv, scale, causal, max_seqlen):
    out = np.full(T * H * Dv, np.nan)
    lse = np.full(H * T, np.nan)
    mxl = np.full(H, -np.inf)
    for start, len_, tile in tiles(cu, max_seqlen, BM):
        for h in range(H):
            q0 = tile * BM
            kv_end = min(q0 + BM, len_) if causal else len_
            n_kt = (kv_end + BN - 1) // BN
            Qs = np.zeros(BM * Dk)
            Ks = np.zeros(BN * (Dk + 1))
            Vs = np.zeros(BN * Dv)
            Ps = np.zeros(BM * BN)
            for i in range(BM * Dk):
                r, c = i // Dk, i % Dk
                Qs[i] = q[((start + q0 + r) * H + h) * Dk + c] if q0 + r < len_ else 0.0
            o = np.zeros((4, R, MAXC, 32))
            m = np.full((4, R, 32), -np.inf)
            l_ = np.zeros((4, R, 32))
            for j in range(n_kt):
                k0 = j * BN
                for i in range(BN * Dk):
                    r, c = i // Dk, i % Dk
                    Ks[r * (Dk + 1) + c] = k[((start + k0 + r) * H + h) * Dk + c] if k0 + r < len_ else 0.0
                for i in range(BN * Dv):
                    r, c = i // Dv, i % Dv
                    Vs[i] = v[((start + k0 + r) * H + h) * Dv + c] if k0 + r < len_ else 0.0
                for w in range(4):
                    acc = np.zeros((R, 32))
                    for d in range(Dk):
                        kv = Ks[LANE * (Dk + 1) + d]
                        for i in range(R):
                            acc[i] += Qs[(w * R + i) * Dk + d] * kv
                    col = k0 + LANE
                    for i in range(R):
                        row = q0 + w * R + i
                        ok = (row < len_) & (col < len_) & ((not causal) | (col <= row))
                        x = np.where(ok, acc[i] * scale, -np.inf)
                        m_new = max(m[w, i, 0], x.max())
                        m_use = 0.0 if m_new == -np.inf else m_new
                        alpha = np.exp(m[w, i] - m_use)
                        p = np.exp(x - m_use)
                        l_[w, i] = l_[w, i] * alpha + p.sum()
                        m[w, i] = m_new
                        Ps[(w * R + i) * BN + LANE] = p
                        o[w, i] *= alpha
                    for jj in range(BN):
                        for c in range(MAXC):
                            lanes = LANE + 32 * c < Dv
                            vv = np.where(lanes, Vs[np.minimum(jj * Dv + LANE + 32 * c, BN * Dv - 1)], 0.0)
                            for i in range(R):
                                o[w, i, c] = np.where(
                                    lanes, o[w, i, c] + Ps[(w * R + i) * BN + jj] * vv, o[w, i, c]
                                )
            for w in range(4):
                for i in range(R):
                    mxl[h] = max(mxl[h], m[w, i, 0])
                    row = q0 + w * R + i
                    if row < len_:
                        tok = start + row
                        ll = l_[w, i, 0]
                        inv = 1.0 / ll if ll > 0 else 0.0
                        for c in range(MAXC):
                            for lane in range(32):
                                if lane + 32 * c < Dv:
                                    out[(tok * H + h) * Dv + lane + 32 * c] = o[w, i, c, lane] * inv
                        lse[h * T + tok] = m[w, i, 0] + np.log(ll) if ll > 0 else -np.inf
    return out, lse, mxl


def bwd(q, k, v, dout, lse, delta, cu, T, H, Dk, Dv, scale, causal, max_seqlen):
    dq_acc = np.zeros(T * H * Dk)
    dk = np.full(T * H * Dk, np.nan)
    dv = np.full(T * H * Dv, np.nan)
    for start, len_, tile in tiles(cu, max_seqlen, BN):
        for h in range(H):
            k0 = tile * BN
            Ks = np.zeros(BN * Dk)
            Vs = np.zeros(BN * Dv)
            Qs = np.zeros(BM * (Dk + 1))
            dOs = np.zeros(BM * (Dv + 1))
            dKa = np.zeros(BN * Dk)
            dVa = np.zeros(BN * Dv)
            Ps = np.zeros(BN * BM)
            dSs = np.zeros(BN * BM)
            lse_s = np.zeros(BM)
            delta_s = np.zeros(BM)
            for i in range(BN * Dk):
                r, c = i // Dk, i % Dk
                Ks[i] = k[((start + k0 + r) * H + h) * Dk + c] if k0 + r < len_ else 0.0
            for i in range(BN * Dv):
                r, c = i // Dv, i % Dv
                Vs[i] = v[((start + k0 + r) * H + h) * Dv + c] if k0 + r < len_ else 0.0
            q_begin = tile if causal else 0
            n_qt = (len_ + BM - 1) // BM
            for qt in range(q_begin, n_qt):
                q0 = qt * BM
                for i in range(BM * Dk):
                    r, c = i // Dk, i % Dk
                    Qs[r * (Dk + 1) + c] = q[((start + q0 + r) * H + h) * Dk + c] if q0 + r < len_ else 0.0
                for i in range(BM * Dv):
                    r, c = i // Dv, i % Dv
                    dOs[r * (Dv + 1) + c] = (
                        dout[((start + q0 + r) * H + h) * Dv + c] if q0 + r < len_ else 0.0
                    )
                for r in range(BM):
                    valid = q0 + r < len_
                    idx = h * T + start + q0 + r
                    lse_s[r] = lse[idx] if valid else 0.0
                    delta_s[r] = delta[idx] if valid else 0.0
                for w in range(4):
                    s = np.zeros((KW, 32))
                    dp = np.zeros((KW, 32))
                    for d in range(Dk):
                        qv = Qs[LANE * (Dk + 1) + d]
                        for i in range(KW):
                            s[i] += qv * Ks[(w * KW + i) * Dk + d]
                    for d in range(Dv):
                        ov = dOs[LANE * (Dv + 1) + d]
                        for i in range(KW):
                            dp[i] += ov * Vs[(w * KW + i) * Dv + d]
                    qq = q0 + LANE
                    for i in range(KW):
                        kl = w * KW + i
                        key = k0 + kl
                        ok = (key < len_) & (qq < len_) & ((not causal) | (key <= qq))
                        p = np.where(ok, np.exp(s[i] * scale - lse_s[LANE]), 0.0)
                        Ps[kl * BM + LANE] = p
                        dSs[kl * BM + LANE] = p * (dp[i] - delta_s[LANE])
                    for i in range(KW):
                        kl = w * KW + i
                        for c in range(Dv):
                            dVa[kl * Dv + c] += sum(
                                Ps[kl * BM + j] * dOs[j * (Dv + 1) + c] for j in range(BM)
                            )
                        for c in range(Dk):
                            dKa[kl * Dk + c] += sum(
                                dSs[kl * BM + j] * Qs[j * (Dk + 1) + c] for j in range(BM)
                            )
                for i in range(BM * Dk):
                    j, c = i // Dk, i % Dk
                    if q0 + j >= len_:
                        continue
                    acc = sum(dSs[kl * BM + j] * Ks[kl * Dk + c] for kl in range(BN))
                    dq_acc[((start + q0 + j) * H + h) * Dk + c] += acc * scale
            for i in range(BN * Dk):
                r, c = i // Dk, i % Dk
                if k0 + r < len_:
                    dk[((start + k0 + r) * H + h) * Dk + c] = dKa[i] * scale
            for i in range(BN * Dv):
                r, c = i // Dv, i % Dv
                if k0 + r < len_:
                    dv[((start + k0 + r) * H + h) * Dv + c] = dVa[i]
    return dq_acc, dk, dv


def check(lens, H, Dk, Dv, causal, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q, k, v, g = (torch.randn(T, H, d, generator=gen, dtype=torch.float64) for d in (Dk, Dk, Dv, Dv))
    cu = [0] + np.cumsum(lens).tolist()
    scale = Dk**-0.5
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ro, rl, rm = reference.mla_attention(*leaves, torch.tensor(cu), scale, causal)
    ro.backward(g)
    flat = [t.numpy().ravel() for t in (q, k, v, g)]
    o, lse, mx = fwd(*flat[:3], cu, T, H, Dk, Dv, scale, causal, max(lens))
    delta = (torch.tensor(o).view(T, H, Dv) * g).sum(-1).transpose(0, 1).contiguous().numpy().ravel()
    dq, dk, dv = bwd(*flat, lse, delta, cu, T, H, Dk, Dv, scale, causal, max(lens))

    def rel(a, ref):
        a = torch.tensor(a).view(ref.shape)
        assert not torch.isnan(a).any(), "unwritten entries"
        return ((a - ref.double()).norm() / ref.double().norm().clamp_min(1.0)).item()

    res = dict(
        out=rel(o, ro),
        lse=rel(lse, rl),
        mx=rel(mx, rm),
        dq=rel(dq, leaves[0].grad),
        dk=rel(dk, leaves[1].grad),
        dv=rel(dv, leaves[2].grad),
    )
    print(lens, H, Dk, Dv, causal, {k_: f"{v_:.1e}" for k_, v_ in res.items()}, flush=True)
    assert all(x < (1e-7 if n in ("lse", "mx") else 1e-10) for n, x in res.items()), res


if __name__ == "__main__":
    check([1], 1, 16, 16, True)
    check([40, 3, 0, 33], 2, 16, 48, True)
    check([45], 1, 48, 16, False)
    print("OK")
