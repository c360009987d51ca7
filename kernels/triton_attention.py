"""FlashAttention-2-style Triton kernel with head edits and streaming probes.

One program handles ``BLOCK_M`` query rows of one (batch row, query head) and walks the visible key tiles
with an online softmax. In the same pass it applies the edits (query scale, score zeroing, additive key-span
biases, softcap, causal / window / padding / general masks) and accumulates the probes:

- argmax: running maximum score and its key index (strictly greater wins, so the first key on ties);
- entropy: ``F = sum_j p_j (s_j - m)`` rescaled when the running max ``m`` moves, ``H = log l - F / l``;
- span masses: ``sum_j p_j [j in span]`` as a (BLOCK_M, BLOCK_P) accumulator, rescaled like the output;
- offset masses: ``p_j`` at the key ``j = q_pos - delta`` for each probe offset ``delta``, a
  (BLOCK_M, BLOCK_O) accumulator rescaled like the span masses (an offset touches at most two key tiles of
  a query block; the others are skipped).

The full pattern, when asked, is written by a second sweep over the key tiles once ``m`` and ``l`` are final.

Decoding (few queries, long key cache) splits the key axis over extra programs (flash-decoding); each split
writes its partial statistics and :func:`_combine` merges them in torch.

Runs on CUDA, and on CPU under ``TRITON_INTERPRET=1`` (set before triton is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .attention import AttentionStats


@triton.jit
def _scores(
    q, offs_m, offs_n, q_abs, Kp, b, hk, skb, skh, skn, skd, offs_d, D, Nk, qmul,
    sz, ks_start, ks_end, kb_vals, KPM, skpm_b, AM, am_b, am_h, am_q, am_k, h, softcap, window,
    HAS_SZ: tl.constexpr, HAS_KB: tl.constexpr, HAS_KPM: tl.constexpr, HAS_AM: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
):
    kmask = offs_n < Nk
    kt = tl.load(
        Kp + b * skb + hk * skh + offs_n[None, :] * skn + offs_d[:, None] * skd,
        mask=kmask[None, :] & (offs_d[:, None] < D), other=0.0,
    )
    if IEEE:
        s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    s = s * qmul
    if HAS_SOFTCAP:
        x = s / softcap
        ax = tl.abs(x)
        t = tl.exp(-2.0 * ax)
        th = (1.0 - t) / (1.0 + t)
        s = softcap * tl.where(x < 0, -th, th)
    if HAS_SZ:
        s = tl.where(sz != 0, 0.0, s)
    if HAS_KB:
        ins = (offs_n[:, None] >= ks_start[None, :]) & (offs_n[:, None] < ks_end[None, :])
        kbv = tl.sum(tl.where(ins, kb_vals[None, :], 0.0), axis=1)
        s = s + kbv[None, :]
    valid = kmask[None, :] & (offs_m[:, None] >= 0)
    if CAUSAL:
        valid = valid & (offs_n[None, :] <= q_abs[:, None])
    if HAS_WINDOW:
        valid = valid & ((q_abs[:, None] - offs_n[None, :]) < window)
        if not CAUSAL:
            valid = valid & ((offs_n[None, :] - q_abs[:, None]) < window)
    if HAS_KPM:
        kp = tl.load(KPM + b * skpm_b + offs_n, mask=kmask, other=0)
        valid = valid & (kp != 0)[None, :]
    if HAS_AM:
        am = tl.load(
            AM + b * am_b + h * am_h + offs_m[:, None] * am_q + offs_n[None, :] * am_k,
            mask=kmask[None, :] & (offs_m[:, None] >= 0), other=0,
        )
        valid = valid & (am != 0)
    s = tl.where(valid, s, float("-inf"))
    return s, valid


@triton.jit
def _attn_fwd(
    Q, K, V, Out,
    QMUL, SZ, OSC, KPM, AM, KSPAN, KBIAS, PSPAN, POFF,
    ARGI, ARGS, ML, FENT, SPM, OFM, PAT, ACC,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
    skpm_b, am_b, am_h, am_q, am_k,
    H, G, Nq, Nk, D, Dv, NKS, NPS, NOS, softcap, window, split_len,
    HAS_SZ: tl.constexpr, HAS_OS: tl.constexpr, HAS_KPM: tl.constexpr, HAS_AM: tl.constexpr,
    HAS_KB: tl.constexpr, HAS_PS: tl.constexpr, HAS_PO: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, PROBE_ARGMAX: tl.constexpr, PROBE_ENT: tl.constexpr,
    RETURN_PATTERN: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_O: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // G
    off = Nk - Nq
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mrow = offs_m < Nq
    q_abs = offs_m + off
    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
        mask=mrow[:, None] & (offs_d[None, :] < D), other=0.0,
    )
    if IEEE:
        q = q.to(tl.float32)
    qmul = tl.load(QMUL + b * H + h)
    sz = 0
    if HAS_SZ:
        sz = tl.load(SZ + b * H + h)
    offs_s = tl.arange(0, BLOCK_S)
    ks_start = offs_s
    ks_end = offs_s
    kb_vals = tl.zeros([BLOCK_S], dtype=tl.float32)
    if HAS_KB:
        smask = offs_s < NKS
        ks_start = tl.load(KSPAN + b * NKS * 2 + offs_s * 2, mask=smask, other=0)
        ks_end = tl.load(KSPAN + b * NKS * 2 + offs_s * 2 + 1, mask=smask, other=0)
        kb_vals = tl.load(KBIAS + (b * H + h) * NKS + offs_s, mask=smask, other=0.0)
    offs_p = tl.arange(0, BLOCK_P)
    ps_start = offs_p
    ps_end = offs_p
    if HAS_PS:
        pmask = offs_p < NPS
        ps_start = tl.load(PSPAN + b * NPS * 2 + offs_p * 2, mask=pmask, other=0)
        ps_end = tl.load(PSPAN + b * NPS * 2 + offs_p * 2 + 1, mask=pmask, other=0)
    offs_o = tl.arange(0, BLOCK_O)

    # key range of this program
    m_first = pid_m * BLOCK_M + off
    m_last = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, Nq - 1) + off
    lo = 0
    hi = Nk
    if CAUSAL:
        hi = tl.minimum(Nk, m_last + 1)
    if HAS_WINDOW:
        lo = tl.maximum(0, m_first - window + 1)
        if not CAUSAL:
            hi = tl.minimum(Nk, m_last + window)
    if SPLIT:
        lo = tl.maximum(lo, pid_s * split_len)
        hi = tl.minimum(hi, pid_s * split_len + split_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    f_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    best_s = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    best_i = tl.full([BLOCK_M], -1, dtype=tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    sacc = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
    oacc = tl.zeros([BLOCK_M, BLOCK_O], dtype=tl.float32)

    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        s, valid = _scores(
            q, offs_m, offs_n, q_abs, K, b, hk, skb, skh, skn, skd, offs_d, D, tl.minimum(Nk, hi), qmul,
            sz, ks_start, ks_end, kb_vals, KPM, skpm_b, AM, am_b, am_h, am_q, am_k, h, softcap, window,
            HAS_SZ, HAS_KB, HAS_KPM, HAS_AM, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, IEEE,
        )
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        if PROBE_ENT:
            m_old = tl.where(m_i == float("-inf"), m_safe, m_i)
            d = tl.where(valid, s - m_safe[:, None], 0.0)
            f_i = alpha * (f_i + l_i * (m_old - m_safe)) + tl.sum(p * d, axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(
            V + b * svb + hk * svh + offs_n[:, None] * svn + offs_dv[None, :] * svd,
            mask=(offs_n[:, None] < Nk) & (offs_dv[None, :] < Dv), other=0.0,
        )
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, vt.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        if PROBE_ARGMAX:
            tmax = tl.max(s, axis=1)
            tidx = tl.argmax(s, axis=1).to(tl.int32) + start
            upd = tmax > best_s
            best_s = tl.where(upd, tmax, best_s)
            best_i = tl.where(upd, tidx, best_i)
        if HAS_PS:
            pin = ((offs_n[:, None] >= ps_start[None, :]) & (offs_n[:, None] < ps_end[None, :])).to(tl.float32)
            sacc = sacc * alpha[:, None] + tl.dot(p, pin, input_precision="ieee")
        if HAS_PO:
            oacc = oacc * alpha[:, None]
            rel = q_abs[:, None] - offs_n[None, :]  # query position - key position
            for o in range(0, NOS):
                dlt = tl.load(POFF + b * NOS + o)
                # the keys q_pos - dlt of this query block lie in [m_first - dlt, m_last - dlt]
                if (dlt >= 0) & (start <= m_last - dlt) & (start + BLOCK_N > m_first - dlt):
                    hit = tl.sum(tl.where(rel == dlt, p, 0.0), axis=1)
                    oacc = oacc + tl.where(offs_o[None, :] == o, hit[:, None], 0.0)
        m_i = m_new

    row = (b * H + h) * Nq + offs_m
    if SPLIT:
        # partial statistics, merged by _combine: (n_split, B*H*Nq, ...)
        prow = pid_s * (tl.num_programs(1) * Nq) + row
        tl.store(ML + prow * 2, m_i, mask=mrow)
        tl.store(ML + prow * 2 + 1, l_i, mask=mrow)
        tl.store(FENT + prow, f_i, mask=mrow)
        tl.store(ACC + prow[:, None] * Dv + offs_dv[None, :], acc, mask=mrow[:, None] & (offs_dv[None, :] < Dv))
        if PROBE_ARGMAX:
            tl.store(ARGS + prow, best_s, mask=mrow)
            tl.store(ARGI + prow, best_i, mask=mrow)
        if HAS_PS:
            tl.store(SPM + prow[:, None] * NPS + offs_p[None, :], sacc, mask=mrow[:, None] & (offs_p[None, :] < NPS))
        if HAS_PO:
            tl.store(OFM + prow[:, None] * NOS + offs_o[None, :], oacc, mask=mrow[:, None] & (offs_o[None, :] < NOS))
    else:
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        o = acc / l_safe[:, None]
        if HAS_OS:
            o = o * tl.load(OSC + b * H + h)
        tl.store(
            Out + b * sob + h * soh + offs_m[:, None] * som + offs_dv[None, :] * sod,
            o.to(Out.dtype.element_ty), mask=mrow[:, None] & (offs_dv[None, :] < Dv),
        )
        if PROBE_ARGMAX:
            tl.store(ARGI + row, tl.where(empty, -1, best_i), mask=mrow)
            m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
            tl.store(ARGS + row, tl.where(empty, 0.0, tl.exp(best_s - m_safe) / l_safe), mask=mrow)
        if PROBE_ENT:
            ent = tl.where(empty, 0.0, tl.log(l_safe) - f_i / l_safe)
            tl.store(FENT + row, ent, mask=mrow)
        if HAS_PS:
            tl.store(
                SPM + row[:, None] * NPS + offs_p[None, :], sacc / l_safe[:, None],
                mask=mrow[:, None] & (offs_p[None, :] < NPS),
            )
        if HAS_PO:
            tl.store(
                OFM + row[:, None] * NOS + offs_o[None, :], oacc / l_safe[:, None],
                mask=mrow[:, None] & (offs_o[None, :] < NOS),
            )
        if RETURN_PATTERN:
            m_safe2 = tl.where(m_i == float("-inf"), 0.0, m_i)
            inv = tl.where(empty, 0.0, 1.0 / l_safe)
            for start in range(lo, hi, BLOCK_N):
                offs_n = start + tl.arange(0, BLOCK_N)
                s, valid = _scores(
                    q, offs_m, offs_n, q_abs, K, b, hk, skb, skh, skn, skd, offs_d, D, tl.minimum(Nk, hi),
                    qmul, sz, ks_start, ks_end, kb_vals, KPM, skpm_b, AM, am_b, am_h, am_q, am_k, h,
                    softcap, window,
                    HAS_SZ, HAS_KB, HAS_KPM, HAS_AM, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, IEEE,
                )
                a = tl.exp(s - m_safe2[:, None]) * inv[:, None]
                tl.store(
                    PAT + row[:, None] * Nk + offs_n[None, :], a,
                    mask=mrow[:, None] & (offs_n[None, :] < tl.minimum(Nk, hi)),
                )


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(max(1, int(x))))


def _combine(B, H, Nq, Dv, n_split, ml, fent, acc, args, argi, spm, probe_argmax, probe_entropy, has_ps,
             ofm=None):
    """Merge per-split partial softmax statistics (flash-decoding)."""
    m = ml[..., 0].view(n_split, B, H, Nq)
    lp = ml[..., 1].view(n_split, B, H, Nq)
    mx = m.amax(0)
    mxs = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    w = torch.exp(m - mxs)  # 0 for empty splits
    lt = (w * lp).sum(0)
    empty = lt == 0
    lsafe = torch.where(empty, torch.ones_like(lt), lt)
    o = (w[..., None] * acc.view(n_split, B, H, Nq, Dv)).sum(0) / lsafe[..., None]
    stats = AttentionStats()
    if probe_argmax:
        bs = args.view(n_split, B, H, Nq)
        bi = argi.view(n_split, B, H, Nq)
        sel = bs.argmax(0, keepdim=True)  # first split on ties: earliest keys
        best = bs.gather(0, sel)[0]
        stats.argmax = torch.where(empty, torch.full_like(lt, -1, dtype=torch.long), bi.gather(0, sel)[0].long())
        stats.argmax_prob = torch.where(empty, torch.zeros_like(lt), torch.exp(best - mxs) / lsafe)
    if probe_entropy:
        ms = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        f = fent.view(n_split, B, H, Nq)
        ftot = (w * (f + lp * (ms - mxs))).sum(0)
        stats.entropy = torch.where(empty, torch.zeros_like(lt), torch.log(lsafe) - ftot / lsafe)
    if has_ps:
        P = spm.shape[-1]
        stats.span_mass = (w[..., None] * spm.view(n_split, B, H, Nq, P)).sum(0) / lsafe[..., None]
    if ofm is not None:
        n_off = ofm.shape[-1]
        stats.offset_mass = (w[..., None] * ofm.view(n_split, B, H, Nq, n_off)).sum(0) / lsafe[..., None]
    return o, stats


def triton_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    causal: bool,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    q_scale: Tensor | None,
    score_zero: Tensor | None,
    out_scale: Tensor | None,
    key_spans: Tensor | None,
    key_bias: Tensor | None,
    probe_argmax: bool,
    probe_entropy: bool,
    probe_spans: Tensor | None,
    return_pattern: bool,
    softcap: float | None,
    window: int | None,
    probe_offsets: Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
) -> tuple[Tensor, AttentionStats]:
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = H // Hkv
    dev = q.device
    f32 = torch.float32
    # float32 dots in IEEE precision for float32 inputs (no TF32), and for every dtype under the CPU
    # interpreter, whose bfloat16 tl.dot is wrong (triton 3.x); half inputs on CUDA use native dots
    ieee = q.dtype == torch.float32 or not q.is_cuda
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError("triton path: q, k, v must share a dtype")
    BLOCK_M = block_m or (16 if Nq <= 16 else 64)
    BLOCK_N = block_n or (32 if not q.is_cuda else 64)
    BLOCK_D = _pow2(D)
    BLOCK_DV = _pow2(Dv)
    if q.is_cuda and BLOCK_D >= 128 and ieee:
        BLOCK_M = min(BLOCK_M, 32)
    n_mblocks = triton.cdiv(Nq, BLOCK_M)

    qmul = torch.full((B, H), scale, dtype=f32, device=dev)
    if q_scale is not None:
        qmul = (qmul * q_scale).contiguous()
    dummy_f = torch.zeros(1, dtype=f32, device=dev)
    dummy_i = torch.zeros(1, dtype=torch.int32, device=dev)
    sz = score_zero.to(torch.int8).contiguous() if score_zero is not None else dummy_i
    osc = out_scale.contiguous() if out_scale is not None else dummy_f
    kpm = key_padding_mask.to(torch.int8).contiguous() if key_padding_mask is not None else dummy_i
    if attn_mask is not None:
        am = attn_mask.to(torch.int8)
        am = am.expand(B, am.shape[1], Nq, Nk)
        am_b, am_h, am_q, am_k = am.stride()
        if am.shape[1] == 1:
            am_h = 0
    else:
        am, am_b, am_h, am_q, am_k = dummy_i, 0, 0, 0, 0
    NKS = key_spans.shape[1] if key_spans is not None else 0
    ksp = key_spans.to(torch.int32).contiguous() if key_spans is not None else dummy_i
    kb = key_bias.to(f32).contiguous() if key_spans is not None else dummy_f
    NPS = probe_spans.shape[1] if probe_spans is not None else 0
    psp = probe_spans.to(torch.int32).contiguous() if probe_spans is not None else dummy_i
    has_ps = probe_spans is not None and NPS > 0
    NOS = probe_offsets.shape[1] if probe_offsets is not None else 0
    pof = probe_offsets.to(torch.int32).contiguous() if probe_offsets is not None else dummy_i
    has_po = probe_offsets is not None and NOS > 0

    # flash-decoding: few query blocks and many keys -> split the key axis
    if num_splits is None:
        num_splits = 1
        if n_mblocks == 1 and not return_pattern and Nk >= 1024:
            sms = torch.cuda.get_device_properties(dev).multi_processor_count if q.is_cuda else 1
            num_splits = max(1, min(triton.cdiv(Nk, 512), triton.cdiv(2 * sms, B * H)))
    split = num_splits > 1
    split_len = triton.cdiv(triton.cdiv(Nk, num_splits), BLOCK_N) * BLOCK_N if split else Nk
    num_splits = triton.cdiv(Nk, split_len) if split else 1

    out = torch.empty(B, H, Nq, Dv, dtype=q.dtype, device=dev)
    rows = B * H * Nq
    nrow = num_splits * rows if split else rows
    argi = torch.empty(nrow, dtype=torch.int32, device=dev) if probe_argmax else dummy_i
    args = torch.empty(nrow, dtype=f32, device=dev) if probe_argmax else dummy_f
    fent = torch.empty(nrow, dtype=f32, device=dev) if (probe_entropy or split) else dummy_f
    spm = torch.empty(nrow, NPS, dtype=f32, device=dev) if has_ps else dummy_f
    ofm = torch.empty(nrow, NOS, dtype=f32, device=dev) if has_po else dummy_f
    pat = torch.zeros(B, H, Nq, Nk, dtype=f32, device=dev) if return_pattern else dummy_f
    ml = torch.empty(nrow, 2, dtype=f32, device=dev) if split else dummy_f
    acc = torch.empty(nrow, Dv, dtype=f32, device=dev) if split else dummy_f

    grid = (n_mblocks, B * H, num_splits)
    _attn_fwd[grid](
        q, k, v, out,
        qmul, sz, osc, kpm, am, ksp, kb, psp, pof,
        argi, args, ml, fent, spm, ofm, pat, acc,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        kpm.stride(0) if key_padding_mask is not None else 0, am_b, am_h, am_q, am_k,
        H, G, Nq, Nk, D, Dv, NKS, NPS, NOS,
        float(softcap) if softcap is not None else 1.0, int(window) if window is not None else 0, split_len,
        HAS_SZ=score_zero is not None, HAS_OS=out_scale is not None, HAS_KPM=key_padding_mask is not None,
        HAS_AM=attn_mask is not None, HAS_KB=NKS > 0, HAS_PS=has_ps, HAS_PO=has_po, CAUSAL=bool(causal),
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, PROBE_ARGMAX=bool(probe_argmax),
        PROBE_ENT=bool(probe_entropy), RETURN_PATTERN=bool(return_pattern), SPLIT=split, IEEE=ieee,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV,
        BLOCK_S=_pow2(NKS), BLOCK_P=_pow2(NPS), BLOCK_O=_pow2(NOS),
    )
    if split:
        o, stats = _combine(
            B, H, Nq, Dv, num_splits, ml.view(num_splits, rows, 2), fent, acc, args, argi,
            spm.view(num_splits, rows, NPS) if has_ps else None, probe_argmax, probe_entropy, has_ps,
            ofm.view(num_splits, rows, NOS) if has_po else None,
        )
        if out_scale is not None:
            o = o * out_scale[:, :, None, None]
        out = o.to(q.dtype)
    else:
        stats = AttentionStats()
        if probe_argmax:
            stats.argmax = argi.view(B, H, Nq).long()
            stats.argmax_prob = args.view(B, H, Nq)
        if probe_entropy:
            stats.entropy = fent.view(B, H, Nq)
        if has_ps:
            stats.span_mass = spm.view(B, H, Nq, NPS)
        if has_po:
            stats.offset_mass = ofm.view(B, H, Nq, NOS)
    if probe_spans is not None and not has_ps:
        stats.span_mass = torch.zeros(B, H, Nq, 0, dtype=f32, device=dev)
    if probe_offsets is not None and not has_po:
        stats.offset_mass = torch.zeros(B, H, Nq, 0, dtype=f32, device=dev)
    if return_pattern:
        stats.pattern = pat
    return out, stats


__all__ = ["triton_attention"]
