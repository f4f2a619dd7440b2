"""Lane-level emulation of csrc/cuda/mla_attention_{fwd,bwd}.cu tensor-core kernels (index logic).

mma.m16n8k16 is emulated from the PTX fragment definition (independent of the loaders), the loaders
transcribe the C++ address arithmetic; float64 math (ROUND=False) must then match the reference to
~1e-12, which checks fragment layouts, padding, masks, tile loops and the online softmax.
"""

import sys

import numpy as np
import torch
from k2_kernels import reference

ROUND = False
PAD = 8
LANE = np.arange(32)
G, TT = LANE >> 2, LANE & 3


def rnd(x):
    if not ROUND:
        return np.asarray(x, dtype=np.float64)
    return torch.tensor(np.asarray(x, dtype=np.float32)).to(torch.bfloat16).double().numpy()


def pair(s, p0, p1):
    return np.stack([s[p0], s[p1]], axis=-1)  # [32, 2]


def load_a(s, ld, r0, c0):
    p = (r0 + G) * ld + c0 + 2 * TT
    return np.stack(
        [
            pair(s, p, p + 1),
            pair(s, p + 8 * ld, p + 8 * ld + 1),
            pair(s, p + 8, p + 9),
            pair(s, p + 8 * ld + 8, p + 8 * ld + 9),
        ],
        axis=1,
    )


def load_a_trans(s, ld, r0, c0):
    p = (c0 + 2 * TT) * ld + r0 + G
    return np.stack(
        [
            pair(s, p, p + ld),
            pair(s, p + 8, p + ld + 8),
            pair(s, p + 8 * ld, p + 9 * ld),
            pair(s, p + 8 * ld + 8, p + 9 * ld + 8),
        ],
        axis=1,
    )


def load_b(s, ld, n0, k0):
    p = (n0 + G) * ld + k0 + 2 * TT
    return np.stack([pair(s, p, p + 1), pair(s, p + 8, p + 9)], axis=1)


def load_b_trans(s, ld, n0, k0):
    p = (k0 + 2 * TT) * ld + n0 + G
    return np.stack([pair(s, p, p + ld), pair(s, p + 8 * ld, p + 9 * ld)], axis=1)


LDMATRIX = True


def ldmatrix(s, addr, num, trans):
    """PTX ldmatrix.m8n8.xnum(.trans).b16: lanes 8j..8j+7 give block j's row addresses; lane l gets
    block j's (row l/4, cols 2(l%4), +1) in register j, or with .trans (rows 2(l%4), +1; col l/4)."""
    out = np.zeros((32, num, 2))
    for j in range(num):
        M = np.stack([s[addr[8 * j + r] : addr[8 * j + r] + 8] for r in range(8)])
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            out[lane, j] = (M[g, 2 * t], M[g, 2 * t + 1]) if not trans else (M[2 * t, g], M[2 * t + 1, g])
    return out


def ld_load_a(s, ld, r0, c0):
    i, j = LANE & 7, LANE >> 3
    assert ld % 8 == 0 and c0 % 8 == 0
    return ldmatrix(s, (r0 + i + (j & 1) * 8) * ld + c0 + (j >> 1) * 8, 4, False)


def ld_load_a_trans(s, ld, r0, c0):
    i, j = LANE & 7, LANE >> 3
    assert ld % 8 == 0 and r0 % 8 == 0
    return ldmatrix(s, (c0 + i + (j >> 1) * 8) * ld + r0 + (j & 1) * 8, 4, True)


def ld_load_b(s, ld, n0, k0):
    i, j = LANE & 7, (LANE >> 3) & 1
    return ldmatrix(s, (n0 + i) * ld + k0 + j * 8, 2, False)


def ld_load_b_trans(s, ld, n0, k0):
    i, j = LANE & 7, (LANE >> 3) & 1
    return ldmatrix(s, (k0 + i + j * 8) * ld + n0, 2, True)


def mma(d, a, b):
    """d [32, 4] += A B from PTX's fragment definitions (m16n8k16, row.col)."""
    A = np.full((16, 16), np.nan)
    B = np.full((16, 8), np.nan)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i in range(8):
            row = g + 8 if i in (2, 3, 6, 7) else g
            col = 2 * t + (i & 1) + (8 if i >= 4 else 0)
            assert np.isnan(A[row, col])
            A[row, col] = rnd(a[lane, i // 2, i % 2])
        for i in range(4):
            row = 2 * t + (i & 1) + (8 if i >= 2 else 0)
            assert np.isnan(B[row, g])
            B[row, g] = rnd(b[lane, i // 2, i % 2])
    assert not np.isnan(A).any() and not np.isnan(B).any()
    D = A @ B
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i in range(4):
            d[lane, i] += D[g + 8 * (i >= 2), 2 * t + (i & 1)]


def load_tile(s, gsrc, seq_start, seq_len, row0, rows, D, H, h):
    for r in range(rows):
        base = r * (D + PAD)
        if row0 + r < seq_len:
            tok = seq_start + row0 + r
            s[base : base + D] = rnd(gsrc[(tok * H + h) * D : (tok * H + h) * D + D])
        else:
            s[base : base + D] = 0.0


def tiles(cu, max_seqlen, BM):
    tps = (max_seqlen + BM - 1) // BM
    for bx in range(tps * (len(cu) - 1)):
        b, tile = bx // tps, tps - 1 - bx % tps
        start, end = cu[b], cu[b + 1]
        if tile * BM < end - start:
            yield start, end - start, tile


def fwd(q, k, v, cu, T, H, DK, DV, scale, causal, max_seqlen):
    BM = BN = 64
    LDK, LDV = DK + PAD, DV + PAD
    out = np.full(T * H * DV, np.nan)
    lse = np.full(H * T, np.nan)
    mxl = np.full(H, -np.inf)
    for start, len_, tile in tiles(cu, max_seqlen, BM):
        for h in range(H):
            Qs = np.zeros(BM * LDK) + np.nan
            Ks = np.zeros(BN * LDK) + np.nan
            Vs = np.zeros(BN * LDV) + np.nan
            q0 = tile * BM
            kv_end = min(q0 + BM, len_) if causal else len_
            n_kt = (kv_end + BN - 1) // BN
            load_tile(Qs, q, start, len_, q0, BM, DK, H, h)
            regs = []
            for _w in range(4):
                regs.append(
                    dict(o=np.zeros((DV // 8, 32, 4)), m=np.full((2, 32), -np.inf), l=np.zeros((2, 32)))
                )
            for j in range(n_kt):
                k0 = j * BN
                load_tile(Ks, k, start, len_, k0, BN, DK, H, h)
                load_tile(Vs, v, start, len_, k0, BN, DV, H, h)
                for w in range(4):
                    R = regs[w]
                    row_a = q0 + w * 16 + G
                    s = np.zeros((BN // 8, 32, 4))
                    for kk in range(DK // 16):
                        a = load_a(Qs, LDK, w * 16, kk * 16)
                        for n in range(BN // 8):
                            mma(s[n], a, load_b(Ks, LDK, n * 8, kk * 16))
                    mt = np.full((2, 32), -np.inf)
                    for n in range(BN // 8):
                        for e in range(4):
                            row = row_a + (e >> 1) * 8
                            col = k0 + n * 8 + 2 * TT + (e & 1)
                            ok = (row < len_) & (col < len_) & ((not causal) | (col <= row))
                            x = np.where(ok, s[n][:, e] * scale, -np.inf)
                            s[n][:, e] = x
                            mt[e >> 1] = np.maximum(mt[e >> 1], x)
                    alpha = np.zeros((2, 32))
                    m_use = np.zeros((2, 32))
                    for r in range(2):
                        mt[r] = np.maximum(mt[r], mt[r][LANE ^ 1])
                        mt[r] = np.maximum(mt[r], mt[r][LANE ^ 2])
                        m_new = np.maximum(R["m"][r], mt[r])
                        m_use[r] = np.where(m_new == -np.inf, 0.0, m_new)
                        alpha[r] = np.exp(R["m"][r] - m_use[r])
                        R["m"][r] = m_new
                    rs = np.zeros((2, 32))
                    for n in range(BN // 8):
                        for e in range(4):
                            p = np.exp(s[n][:, e] - m_use[e >> 1])
                            s[n][:, e] = p
                            rs[e >> 1] += p
                    for r in range(2):
                        R["l"][r] = R["l"][r] * alpha[r] + rs[r]
                    for n in range(DV // 8):
                        R["o"][n][:, 0:2] *= alpha[0][:, None]
                        R["o"][n][:, 2:4] *= alpha[1][:, None]
                    for kk in range(BN // 16):
                        a = np.stack(
                            [
                                s[2 * kk][:, 0:2],
                                s[2 * kk][:, 2:4],
                                s[2 * kk + 1][:, 0:2],
                                s[2 * kk + 1][:, 2:4],
                            ],
                            axis=1,
                        )
                        for n in range(DV // 8):
                            mma(R["o"][n], a, load_b_trans(Vs, LDV, n * 8, kk * 16))
            for w in range(4):
                R = regs[w]
                row_a = q0 + w * 16 + G
                for r in range(2):
                    l = R["l"][r].copy()
                    l = l + l[LANE ^ 1]
                    l = l + l[LANE ^ 2]
                    row = row_a + 8 * r
                    for lane in range(32):
                        if row[lane] < len_:
                            tok = start + row[lane]
                            inv = 1.0 / l[lane] if l[lane] > 0 else 0.0
                            base = (tok * H + h) * DV + 2 * TT[lane]
                            for n in range(DV // 8):
                                out[base + n * 8] = rnd(R["o"][n][lane, 2 * r] * inv)
                                out[base + n * 8 + 1] = rnd(R["o"][n][lane, 2 * r + 1] * inv)
                            if TT[lane] == 0:
                                lse[h * T + tok] = (
                                    R["m"][r][lane] + np.log(l[lane]) if l[lane] > 0 else -np.inf
                                )
                mxl[h] = max(mxl[h], np.max(np.maximum(R["m"][0], R["m"][1])))
    return out, lse, mxl


def bwd(q, k, v, dout, lse, delta, cu, T, H, DK, DV, scale, causal, max_seqlen):
    BM = BN = 64
    LDK, LDV, LDS, LDA = DK + PAD, DV + PAD, BM + PAD, DK + PAD
    dq_acc = np.zeros(T * H * DK)
    dk = np.full(T * H * DK, np.nan)
    dv = np.full(T * H * DV, np.nan)
    for start, len_, tile in tiles(cu, max_seqlen, BN):
        for h in range(H):
            Ks = np.zeros(BN * LDK) + np.nan
            Vs = np.zeros(BN * LDV) + np.nan
            Qs = np.zeros(BM * LDK) + np.nan
            dOs = np.zeros(BM * LDV) + np.nan
            dSs = np.zeros(BN * LDS) + np.nan
            dKa = np.zeros(BN * LDA)
            lse_s = np.zeros(BM)
            delta_s = np.zeros(BM)
            k0 = tile * BN
            load_tile(Ks, k, start, len_, k0, BN, DK, H, h)
            load_tile(Vs, v, start, len_, k0, BN, DV, H, h)
            dv_acc = [np.zeros((DV // 8, 32, 4)) for _ in range(4)]
            q_begin = tile if causal else 0
            n_qt = (len_ + BM - 1) // BM
            for qt in range(q_begin, n_qt):
                q0 = qt * BM
                load_tile(Qs, q, start, len_, q0, BM, DK, H, h)
                load_tile(dOs, dout, start, len_, q0, BM, DV, H, h)
                for r in range(BM):
                    valid = q0 + r < len_
                    idx = h * T + start + q0 + r
                    lse_s[r] = lse[idx] if valid else 0.0
                    delta_s[r] = delta[idx] if valid else 0.0
                for w in range(4):
                    key_a = k0 + w * 16 + G
                    st = np.zeros((BM // 8, 32, 4))
                    dpt = np.zeros((BM // 8, 32, 4))
                    for kk in range(DK // 16):
                        a = load_a(Ks, LDK, w * 16, kk * 16)
                        for n in range(BM // 8):
                            mma(st[n], a, load_b(Qs, LDK, n * 8, kk * 16))
                    for kk in range(DV // 16):
                        a = load_a(Vs, LDV, w * 16, kk * 16)
                        for n in range(BM // 8):
                            mma(dpt[n], a, load_b(dOs, LDV, n * 8, kk * 16))
                    for n in range(BM // 8):
                        for e in range(4):
                            key = key_a + (e >> 1) * 8
                            ql = n * 8 + 2 * TT + (e & 1)
                            qq = q0 + ql
                            ok = (key < len_) & (qq < len_) & ((not causal) | (key <= qq))
                            p = np.where(ok, np.exp(st[n][:, e] * scale - lse_s[ql]), 0.0)
                            st[n][:, e] = p
                            dpt[n][:, e] = p * (dpt[n][:, e] - delta_s[ql]) * scale
                    pa, da = [], []
                    for kk in range(BM // 16):
                        pa.append(
                            np.stack(
                                [
                                    st[2 * kk][:, 0:2],
                                    st[2 * kk][:, 2:4],
                                    st[2 * kk + 1][:, 0:2],
                                    st[2 * kk + 1][:, 2:4],
                                ],
                                axis=1,
                            )
                        )
                        da.append(
                            np.stack(
                                [
                                    dpt[2 * kk][:, 0:2],
                                    dpt[2 * kk][:, 2:4],
                                    dpt[2 * kk + 1][:, 0:2],
                                    dpt[2 * kk + 1][:, 2:4],
                                ],
                                axis=1,
                            )
                        )
                        drow = (w * 16 + G) * LDS + kk * 16 + 2 * TT
                        for off, reg in ((0, 0), (8 * LDS, 1), (8, 2), (8 * LDS + 8, 3)):
                            dSs[drow + off] = rnd(da[kk][:, reg, 0])
                            dSs[drow + off + 1] = rnd(da[kk][:, reg, 1])
                    for n in range(DV // 8):
                        for kk in range(BM // 16):
                            mma(dv_acc[w][n], pa[kk], load_b_trans(dOs, LDV, n * 8, kk * 16))
                    for n in range(DK // 8):
                        c = np.zeros((32, 4))
                        for kk in range(BM // 16):
                            mma(c, da[kk], load_b_trans(Qs, LDK, n * 8, kk * 16))
                        r0 = (w * 16 + G) * LDA + n * 8 + 2 * TT
                        dKa[r0] += c[:, 0]
                        dKa[r0 + 1] += c[:, 1]
                        dKa[r0 + 8 * LDA] += c[:, 2]
                        dKa[r0 + 8 * LDA + 1] += c[:, 3]
                # __syncthreads: dS^T complete
                for w in range(4):
                    qa = [load_a_trans(dSs, LDS, w * 16, kk * 16) for kk in range(BN // 16)]
                    qrow = q0 + w * 16 + G
                    for n in range(DK // 8):
                        c = np.zeros((32, 4))
                        for kk in range(BN // 16):
                            mma(c, qa[kk], load_b_trans(Ks, LDK, n * 8, kk * 16))
                        for lane in range(32):
                            base0 = ((start + qrow[lane]) * H + h) * DK + 2 * TT[lane] + n * 8
                            if qrow[lane] < len_:
                                dq_acc[base0] += c[lane, 0]
                                dq_acc[base0 + 1] += c[lane, 1]
                            if qrow[lane] + 8 < len_:
                                dq_acc[base0 + 8 * H * DK] += c[lane, 2]
                                dq_acc[base0 + 8 * H * DK + 1] += c[lane, 3]
            for w in range(4):
                key_a = k0 + w * 16 + G
                for r in range(2):
                    key = key_a + 8 * r
                    for lane in range(32):
                        if key[lane] < len_:
                            base = ((start + key[lane]) * H + h) * DV + 2 * TT[lane]
                            for n in range(DV // 8):
                                dv[base + n * 8] = rnd(dv_acc[w][n][lane, 2 * r])
                                dv[base + n * 8 + 1] = rnd(dv_acc[w][n][lane, 2 * r + 1])
            for i in range(BN * (DK // 2)):
                r, c = i // (DK // 2), (i % (DK // 2)) * 2
                if k0 + r < len_:
                    base = ((start + k0 + r) * H + h) * DK + c
                    dk[base] = rnd(dKa[r * LDA + c])
                    dk[base + 1] = rnd(dKa[r * LDA + c + 1])
    return rnd(dq_acc), dk, dv


def check(lens, H, DK, DV, causal, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = torch.randn(T, H, DK, generator=gen, dtype=torch.float64)
    k = torch.randn(T, H, DK, generator=gen, dtype=torch.float64)
    v = torch.randn(T, H, DV, generator=gen, dtype=torch.float64)
    g = torch.randn(T, H, DV, generator=gen, dtype=torch.float64)
    if ROUND:
        q, k, v, g = (t.to(torch.bfloat16).double() for t in (q, k, v, g))
    cu = [0] + np.cumsum(lens).tolist()
    scale = DK**-0.5
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ro, rl, rm = reference.mla_attention(*leaves, torch.tensor(cu), scale, causal)
    ro.backward(g)
    o, lse, mx = fwd(
        q.numpy().ravel(), k.numpy().ravel(), v.numpy().ravel(), cu, T, H, DK, DV, scale, causal, max(lens)
    )
    out_t = torch.tensor(o).view(T, H, DV)
    # delta from the kernel's (rounded) out, as delta_kernel does
    delta = (out_t * g).sum(-1).transpose(0, 1).contiguous().numpy().ravel()
    dq, dk, dv = bwd(
        q.numpy().ravel(),
        k.numpy().ravel(),
        v.numpy().ravel(),
        g.numpy().ravel(),
        lse,
        delta,
        cu,
        T,
        H,
        DK,
        DV,
        scale,
        causal,
        max(lens),
    )

    def rel(a, ref):
        a = torch.tensor(a).view(ref.shape)
        assert not torch.isnan(a).any(), "unwritten entries"
        return ((a - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()

    res = dict(
        out=rel(o, ro),
        lse=rel(lse, rl),
        mx=rel(mx, rm),
        dq=rel(dq, leaves[0].grad),
        dk=rel(dk, leaves[1].grad),
        dv=rel(dv, leaves[2].grad),
    )
    print(lens, H, DK, DV, causal, {k_: f"{v_:.1e}" for k_, v_ in res.items()}, flush=True)
    return res


if __name__ == "__main__":
    ROUND = "bf16" in sys.argv[1:]
    if "ldmatrix" in sys.argv[1:]:
        load_a, load_a_trans, load_b, load_b_trans = ld_load_a, ld_load_a_trans, ld_load_b, ld_load_b_trans
        print("ldmatrix loaders")
    tol = 1e-2 if ROUND else 1e-10
    for case in [
        ([1], 1, 16, 16, True),
        ([70], 1, 32, 16, True),
        ([5, 64, 1, 0, 80], 2, 16, 32, True),
        ([70, 3], 1, 32, 16, False),
        ([130], 1, 48, 16, True),
    ]:
        r = check(*case)
        assert all(x < (max(tol, 1e-7) if n in ("lse", "mx") else tol) for n, x in r.items()), r
    print("OK")
