"""The benchmark's correctness gate and its counting rules.

* ``reference``: SPEC §3 in float32 (the judge) and in the input dtype (FlashAttention's
  "ref_lp": bf16/f16 scores and probabilities, fp32 softmax), chunked over rows so that a
  16k x 16k problem needs about a GiB of scratch; GQA is folded into the rows, never expanded.
* ``check``: SPEC §6 — max|out - ref32| <= 2 * max|ref_lp - ref32| + 1e-5, lse within 1e-3
  abs/rel, -inf exactly where a row sees no key, no NaN, every output element written.
* ``valid_pairs`` / ``attn_flops`` / ``kv_bytes``: FLOPs count only (query, key) pairs that
  pass the mask (bottom-right aligned causal / window), 4 * D FLOPs per pair per head.

Device-agnostic: the same code checks CPU (tiny) and CUDA runs.
"""


import torch

LSE_TOL = 1e-3  # SPEC §6: lse within 1e-3 abs/rel of the fp32 reference


# ---- Counting --------------------------------------------------------------------------------


def _window(causal, window):
    left, right = window
    if causal:
        right = 0
    return left, right


def valid_pairs(sq, sk, causal=False, window=(-1, -1)):
    """Number of (i, j) with key j valid for query row i (SPEC §3, bottom-right aligned)."""
    if sq <= 0 or sk <= 0:
        return 0
    left, right = _window(causal, window)
    if left < 0 and right < 0:
        return sq * sk
    i = torch.arange(sq, dtype=torch.int64)
    off = sk - sq
    lo = torch.clamp(i + off - left, min=0) if left >= 0 else torch.zeros_like(i)
    hi = torch.clamp(i + off + right, max=sk - 1) if right >= 0 else torch.full_like(i, sk - 1)
    return int(torch.clamp(hi - lo + 1, min=0).sum().item())


def attn_flops(batch, heads_q, head_dim, pairs):
    """Forward FLOPs: two matmuls (QK^T and PV), 2 FLOPs per multiply-add each."""
    return 4 * batch * heads_q * head_dim * pairs


def kv_bytes(batch, heads_kv, seqlen_k, head_dim, elem_bytes=2):
    """Bytes of K and V a decode step must read at least once."""
    return 2 * batch * heads_kv * seqlen_k * head_dim * elem_bytes


# ---- Reference -------------------------------------------------------------------------------


def _valid_mask(rows_i, sq, sk, left, right, device):
    """Bool [rows, sk]: key j valid for query row i (rows_i holds each row's i)."""
    j = torch.arange(sk, device=device)[None, :]
    i = rows_i[:, None]
    off = sk - sq
    m = torch.ones(rows_i.numel(), sk, dtype=torch.bool, device=device)
    if left >= 0:
        m &= j >= i + off - left
    if right >= 0:
        m &= j <= i + off + right
    return m


def _softmax_rows(s):
    """(lse, p) of fp32 scores with -inf for masked keys; rows with no key get p = 0, lse -inf."""
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    p = torch.nan_to_num(p, nan=0.0)  # (-inf) - (-inf) on rows with no valid key
    return lse, p


@torch.no_grad()
def reference(q, k, v, scale, causal=False, window=(-1, -1), budget_bytes=1 << 30, fp8=False):
    """Dense reference. q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D].

    Returns (out32 [B, Sq, Hq, D] fp32, lse32 [B, Hq, Sq] fp32, out_lp [B, Sq, Hq, D] q.dtype),
    and with fp8 out_lp8 (bf16) fourth: the fp8 kernels' low-precision path — fp32 scores,
    probabilities exp(s - rowmax) times 2^8 rounded to e4m3 for P V, the fp32 row sum —, the
    yardstick of an fp8 call (SPEC §6).
    """
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    dev = q.device
    left, right = _window(causal, window)
    masked = left >= 0 or right >= 0
    out32 = torch.empty(B, Sq, Hq, D, dtype=torch.float32, device=dev)
    out_lp = torch.empty(B, Sq, Hq, D, dtype=q.dtype, device=dev)
    lse32 = torch.empty(B, Hq, Sq, dtype=torch.float32, device=dev)
    out_lp8 = torch.empty(B, Sq, Hq, D, dtype=torch.bfloat16, device=dev) if fp8 else None
    rows = g * Sq
    # Scratch per chunk: fp32 scores + probabilities for both paths, about 4 [Hkv, rc, Sk] fp32.
    rc = max(1, min(rows, budget_bytes // max(1, Hkv * max(Sk, 1) * 4 * 4)))
    for b in range(B):
        # Head h = kv * g + r reads kv head kv: fold the g query heads of a group into rows.
        qb = q[b].permute(1, 0, 2).reshape(Hkv, rows, D)
        kb = k[b].permute(1, 0, 2)  # [Hkv, Sk, D]
        vb = v[b].permute(1, 0, 2)
        kb32, vb32 = kb.float(), vb.float()
        o32 = torch.empty(Hkv, rows, D, dtype=torch.float32, device=dev)
        olp = torch.empty(Hkv, rows, D, dtype=q.dtype, device=dev)
        l32 = torch.empty(Hkv, rows, dtype=torch.float32, device=dev)
        olp8 = torch.empty(Hkv, rows, D, dtype=torch.bfloat16, device=dev) if fp8 else None
        for r0 in range(0, rows, rc):
            r1 = min(rows, r0 + rc)
            qc = qb[:, r0:r1]
            mask = None
            if masked:
                rows_i = torch.arange(r0, r1, device=dev) % Sq
                mask = _valid_mask(rows_i, Sq, Sk, left, right, dev)
            # fp32 path (the judge)
            s = torch.matmul(qc.float(), kb32.transpose(1, 2)) * scale
            if mask is not None:
                s.masked_fill_(~mask, float("-inf"))
            lse, p = _softmax_rows(s)
            if fp8:  # exp(s - m) = p exp(lse - m), m the row max
                m = s.amax(-1, keepdim=True)
                pm = p * torch.nan_to_num(torch.exp(lse[..., None] - m), nan=0.0)
                p8 = (pm * 256).to(torch.float8_e4m3fn).float() / 256
                olp8[:, r0:r1] = (torch.matmul(p8, vb32) / pm.sum(-1, keepdim=True)
                                  .clamp(min=1e-30)).to(torch.bfloat16)
                del m, pm, p8
            del s
            l32[:, r0:r1] = lse
            o32[:, r0:r1] = torch.matmul(p, vb32)
            del p
            # low-precision path: scores rounded to the input dtype, P rounded before PV
            s = torch.matmul(qc, kb.transpose(1, 2)).float() * scale
            if mask is not None:
                s.masked_fill_(~mask, float("-inf"))
            _, p = _softmax_rows(s)
            del s
            olp[:, r0:r1] = torch.matmul(p.to(q.dtype), vb)
            del p
        out32[b] = o32.reshape(Hq, Sq, D).permute(1, 0, 2)
        out_lp[b] = olp.reshape(Hq, Sq, D).permute(1, 0, 2)
        lse32[b] = l32.reshape(Hq, Sq)
        if fp8:
            out_lp8[b] = olp8.reshape(Hq, Sq, D).permute(1, 0, 2)
    return (out32, lse32, out_lp, out_lp8) if fp8 else (out32, lse32, out_lp)


@torch.no_grad()
def reference_varlen(q, k, v, cu_q, cu_k, scale, causal=False, window=(-1, -1),
                     budget_bytes=1 << 30):
    """Varlen reference. q [total_q, Hq, D], k/v [total_k, Hkv, D], cu_* python lists.

    Returns (out32 [total_q, Hq, D], lse32 packed [Hq, total_q], out_lp [total_q, Hq, D]).
    """
    total_q, Hq, D = q.shape
    out32 = torch.zeros(total_q, Hq, D, dtype=torch.float32, device=q.device)
    out_lp = torch.zeros(total_q, Hq, D, dtype=q.dtype, device=q.device)
    lse32 = torch.full((Hq, total_q), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q1 == q0:
            continue
        if k1 == k0:
            continue  # out 0, lse -inf (SPEC §4)
        o, l, olp = reference(q[q0:q1][None], k[k0:k1][None], v[k0:k1][None], scale, causal,
                              window, budget_bytes)
        out32[q0:q1] = o[0]
        out_lp[q0:q1] = olp[0]
        lse32[:, q0:q1] = l[0]
    return out32, lse32, out_lp


# ---- The check -------------------------------------------------------------------------------


def normalize_lse(lse, batch, heads, seqlen_q):
    """A backend's dense LSE as [B, H, Sq] fp32, or None if its layout is not recognised.

    Accepts [B, H, Sq], [B, H, Sq, 1] (cuDNN) and [B, H, Sq rounded up] (memory-efficient pads
    the row dimension to a multiple of 32).
    """
    if lse is None:
        return None
    t = lse
    while t.dim() > 3 and t.shape[-1] == 1:
        t = t.squeeze(-1)
    if t.dim() == 3 and t.shape[0] == batch and t.shape[1] == heads and t.shape[2] >= seqlen_q:
        return t[..., :seqlen_q].float()
    return None


def normalize_varlen_lse(lse, heads, cu_q):
    """A backend's varlen LSE as packed [H, total_q], from packed [H, total_q], [1, H, >= total_q]
    or padded [B, H, >= max_seqlen_q]; None if the layout is not recognised."""
    if lse is None:
        return None
    total_q = cu_q[-1]
    nb = len(cu_q) - 1
    t = lse
    while t.dim() > 3 and t.shape[-1] == 1:
        t = t.squeeze(-1)
    if t.dim() == 2 and t.shape[0] == heads and t.shape[1] == total_q:
        return t.float()
    if t.dim() == 3 and t.shape[0] == 1 and t.shape[1] == heads and t.shape[2] >= total_q \
            and nb != 1:
        return t[0, :, :total_q].float()  # one packed "batch" (memory-efficient's varlen)
    if t.dim() == 3 and t.shape[0] == nb and t.shape[1] == heads:
        maxq = max(cu_q[b + 1] - cu_q[b] for b in range(nb)) if nb else 0
        if t.shape[2] < maxq:
            return None
        packed = torch.empty(heads, total_q, dtype=torch.float32, device=t.device)
        for b in range(nb):
            n = cu_q[b + 1] - cu_q[b]
            packed[:, cu_q[b]:cu_q[b + 1]] = t[b, :, :n].float()
        return packed
    return None


def check(out, lse, ref, lse_expected=True, fp8=False):
    """Judge one backend's result against the reference (SPEC §6).

    out: the backend's output already in the reference's layout; lse: normalised (or None).
    fp8: the yardstick is the fp8 low-precision path (ref's fourth entry, reference(fp8=True)).
    Returns a dict: ok (bool), check ('PASS'/'FAIL'), err_out, tol_out, err_lse, note.
    """
    out32, lse32, out_lp = ref[:3]
    if fp8:
        out_lp = ref[3]
    res = {"ok": False, "check": "FAIL", "err_out": float("nan"), "tol_out": float("nan"),
           "err_lse": float("nan"), "note": ""}
    if out is None:
        res["note"] = "no output"
        return res
    if tuple(out.shape) != tuple(out32.shape):
        res["note"] = f"output shape {tuple(out.shape)} != {tuple(out32.shape)}"
        return res
    o = out.float()
    base = (out_lp.float() - out32).abs().max().item() if out32.numel() else 0.0
    tol = 2.0 * base + 1e-5
    res["tol_out"] = tol
    if not bool(torch.isfinite(o).all()):
        res["note"] = "non-finite output (NaN/inf, or elements never written)"
        return res
    err = (o - out32).abs().max().item() if out32.numel() else 0.0
    res["err_out"] = err
    notes = []
    ok = err <= tol
    if not ok:
        notes.append(f"out error {err:.3g} > tol {tol:.3g}")
    if lse_expected:
        if lse is None:
            notes.append("lse layout not recognised (not checked)")
        else:
            ref_ninf = torch.isneginf(lse32)
            if bool(torch.isnan(lse).any()):
                ok = False
                notes.append("NaN in lse")
            elif not bool(torch.equal(torch.isneginf(lse), ref_ninf)):
                ok = False
                notes.append("-inf rows differ from the reference")
            else:
                fin = ~ref_ninf
                if bool(fin.any()):
                    d = (lse[fin] - lse32[fin]).abs()
                    excess = (d - LSE_TOL * lse32[fin].abs()).max().item()
                    res["err_lse"] = d.max().item()
                    if excess > LSE_TOL:
                        ok = False
                        notes.append(f"lse error {res['err_lse']:.3g} beyond 1e-3 abs/rel")
                else:
                    res["err_lse"] = 0.0
    res["ok"] = ok
    res["check"] = "PASS" if ok else "FAIL"
    res["note"] = "; ".join(notes)
    return res

