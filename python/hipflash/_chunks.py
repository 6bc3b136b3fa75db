"""FlashAttention 3's attention_chunk (Llama 4's chunked attention): query row i, at key position
p = i + seqlen_k - seqlen_q (bottom-right aligned), sees only the keys of its chunk,
[p - p mod C, p - p mod C + C), besides what causal / window allow.

Run as hipflash's varlen attention over pieces: a chunk's query rows and its keys are one
sequence of the packed call. The rows of a piece are contiguous, so dense q, k, v are packed
views (no copies) and a varlen batch is its own packing refined; rows before the first key
(p < 0) are a piece without keys, and keys no query sees (before the first query's chunk) a
piece without queries. Each piece keeps the call's alignment: its last query row and its last
key are as far apart as in the whole call, so causal, windows, ALiBi's distances and the
softcap apply within it unchanged, and a sequence's ALiBi slopes and fp8 descales are its
pieces'. The kernels are the varlen ones: a dense call with chunks runs at varlen speed (and its
gradients by the varlen backward; fp8 is forward only).
"""
import torch


def pieces(seqlen_q, seqlen_k, chunk):
    """[(query rows, keys)] of one sequence, covering its rows and keys in order."""
    shift = seqlen_k - seqlen_q
    out, i = [], 0
    if shift < 0:  # rows before the first key see none
        i = min(-shift, seqlen_q)
        out.append((i, 0))
    if i == seqlen_q:
        return out + ([(0, seqlen_k)] if seqlen_k else [])
    start = (i + shift) - (i + shift) % chunk  # the first row's chunk
    if start:
        out.append((0, start))
    while i < seqlen_q:
        end = min(start + chunk, seqlen_k)
        rows = min(end - shift, seqlen_q) - i  # the rows whose position is below `end`
        out.append((rows, end - start))
        i, start = i + rows, end
    return out


def split(lens_q, lens_k, chunk, keyed_only=False):
    """Every sequence cut into its pieces (chunk 0: whole), in order: lists of the owning
    sequence, the piece's query rows, its keys and its first key in the sequence. keyed_only:
    pieces without query rows left out (a caller that reads each piece's keys through a table
    of its own needs no place for them)."""
    owner, rows_q, rows_k, key0 = [], [], [], []
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        j = 0
        for nq, nk in (pieces(sq, sk, chunk) if chunk else [(sq, sk)]):
            if nq or not keyed_only:
                owner.append(b)
                rows_q.append(nq)
                rows_k.append(nk)
                key0.append(j)
            j += nk
    return owner, rows_q, rows_k, key0


def split_used(lens_q, lens_k, used_q, used_k, chunk):
    """split() of sequences that use only their first used_q[b] rows and used_k[b] keys
    (FlashAttention 3's seqused): the pieces cut the used rows and keys, and each sequence's
    unused tail joins its last piece as that piece's unused rows and keys. Returns split()'s
    lists (key0 left out) and each piece's used rows and keys."""
    owner, rows_q, rows_k, piece_q, piece_k = [], [], [], [], []
    for b, (sq, sk, uq, uk) in enumerate(zip(lens_q, lens_k, used_q, used_k)):
        cut = pieces(uq, uk, chunk) or [(0, 0)]
        for i, (nq, nk) in enumerate(cut):
            last = i == len(cut) - 1
            owner.append(b)
            piece_q.append(nq)
            piece_k.append(nk)
            rows_q.append(nq + (sq - uq if last else 0))
            rows_k.append(nk + (sk - uk if last else 0))
    return owner, rows_q, rows_k, piece_q, piece_k


def prefix(lens, first, device):
    """int32 prefix sums of lens from `first` (cu_seqlens), on device."""
    cu = torch.tensor([first] + lens, dtype=torch.int64).cumsum(0)
    return cu.to(torch.int32).to(device)


def per_piece(per_sequence, owner):
    """A per-sequence argument ([B, ...]: ALiBi slopes [B, H], fp8 descales [B, Hkv]) as one
    per piece, its sequence's row; shared ones ([H] slopes, [] / [1] descales) as they are."""
    if per_sequence is None or per_sequence.dim() != 2:
        return per_sequence
    return per_sequence.index_select(
        0, torch.tensor(owner, dtype=torch.int64, device=per_sequence.device))


def packed_call(varlen_fn, q, k, v, lens_q, lens_k, first_q, first_k, chunk, per_batch,
                kw, used=None):
    """Runs varlen_fn (hipflash.flash_attn_varlen_func) on packed q [Tq, H, D], k / v
    [Tk, Hkv, D] whose sequences have lengths lens_q / lens_k from rows first_q / first_k, each
    cut into its chunk pieces; per_batch: {argument name: tensor or None} of the per-sequence
    arguments (per_piece); used: the sequences' (used rows, used keys) lists (seqused).
    Returns (out, lse packed [H, Tq])."""
    for name, t in per_batch.items():  # checked here: a piece's row is its sequence's
        if t is None or t.dim() not in (1, 2):
            continue  # (the varlen call reports other ranks)
        # ALiBi's slopes a query head each, the descales a kv head each (SPEC §3).
        heads = q.shape[-2] if name == "alibi_slopes" else k.shape[-2]
        if t.dim() == 2 and tuple(t.shape) != (len(lens_q), heads) or \
                t.dim() == 1 and name == "alibi_slopes" and t.shape[0] != heads:
            want = f"[batch = {len(lens_q)}, {heads}]" + (f" or [{heads}]"
                                                          if name == "alibi_slopes" else "")
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if used is None:
        owner, rows_q, rows_k, _ = split(lens_q, lens_k, chunk)
    else:
        owner, rows_q, rows_k, piece_q, piece_k = split_used(lens_q, lens_k, *used, chunk)
        as_tensor = lambda n: torch.tensor(n, dtype=torch.int32).to(q.device)  # noqa: E731
        kw = dict(kw, seqused_q=as_tensor(piece_q), seqused_k=as_tensor(piece_k))
    return varlen_fn(q, k, v, prefix(rows_q, first_q, q.device),
                     prefix(rows_k, first_k, q.device), max(rows_q, default=0),
                     max(rows_k, default=0), return_lse=True, lse_layout="packed",
                     **{name: per_piece(t, owner) for name, t in per_batch.items()}, **kw)


def dense(varlen_fn, q, k, v, chunk, out, per_batch, kw):
    """flash_attn_func's call with attention_chunk: q [B, Sq, H, D], k / v [B, Sk, Hkv, D].
    Returns (out [B, Sq, H, D], lse [B, H, Sq])."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:2] != v.shape[:2] or \
            k.shape[0] != q.shape[0]:
        raise ValueError(f"q must be [batch, seqlen_q, nheads, headdim] and k, v [batch, "
                         f"seqlen_k, nheads_k, headdim] of the same batch, got {list(q.shape)}, "
                         f"{list(k.shape)}, {list(v.shape)}")
    batch, seqlen_q, heads, dim = q.shape
    seqlen_k = k.shape[1]
    flat = [t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]) for t in (q, k, v)]
    if out is not None:
        if out.shape != q.shape:
            raise ValueError(f"out must have q's shape {list(q.shape)}, got {list(out.shape)}")
        try:
            kw = dict(kw, out=out.view(-1, heads, dim))
        except RuntimeError:
            raise ValueError("out= with attention_chunk must be viewable as packed rows "
                             "[batch * seqlen_q, nheads, headdim] (contiguous over batch and "
                             "seqlen)") from None
    o, lse = packed_call(varlen_fn, *flat, [seqlen_q] * batch, [seqlen_k] * batch, 0, 0, chunk,
                         per_batch, kw)
    lse = lse.view(heads, batch, seqlen_q).transpose(0, 1).contiguous()
    return (out if out is not None else o.view(batch, seqlen_q, heads, dim)), lse


def _used(seqused, name, lens):
    """seqused_q / seqused_k's values (the varlen call's own checks, made here because the
    pieces' counts are derived from them), or the sequences' lengths when not given."""
    if seqused is None:
        return lens
    if seqused.dtype != torch.int32 or seqused.shape != (len(lens),):
        raise ValueError(f"{name} must be int32 of shape [batch] = [{len(lens)}], got "
                         f"{seqused.dtype} {list(seqused.shape)}")
    used = seqused.tolist()
    for b, (u, n) in enumerate(zip(used, lens)):
        if not 0 <= u <= n:
            raise ValueError(f"{name}[{b}] = {u} must be in [0, {n}] (the sequence's cu_seqlens "
                             "length)")
    return used


def varlen(varlen_fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, chunk, lse_layout,
           per_batch, kw, seqused_q=None, seqused_k=None):
    """flash_attn_varlen_func's call with attention_chunk (the sequences' bounds, and seqused
    when given, copied to the host once). Returns (out, lse in lse_layout)."""
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.dim() != 1 or \
            cu_seqlens_q.numel() < 1:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be 1-D of length batch + 1")
    bounds = torch.stack([cu_seqlens_q, cu_seqlens_k]).tolist()
    cu_q, cu_k = bounds
    lens_q = [b - a for a, b in zip(cu_q[:-1], cu_q[1:])]
    lens_k = [b - a for a, b in zip(cu_k[:-1], cu_k[1:])]
    if any(n < 0 for n in lens_q + lens_k):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be non-decreasing")
    if max(lens_q, default=0) > max_seqlen_q:
        raise ValueError(f"a sequence has more than max_seqlen_q = {max_seqlen_q} rows")
    used = None
    if seqused_q is not None or seqused_k is not None:
        used = (_used(seqused_q, "seqused_q", lens_q), _used(seqused_k, "seqused_k", lens_k))
    o, lse = packed_call(varlen_fn, q, k, v, lens_q, lens_k, cu_q[0], cu_k[0], chunk,
                         per_batch, kw, used)
    if lse_layout == "packed":
        return o, lse
    return o, padded_lse(lse, cu_q, max_seqlen_q)


def padded_lse(lse, cu, max_seqlen):
    """A packed LSE [H, T] of the sequences with prefix sums cu (host ints) in the padded layout
    [B, H, max_seqlen], -inf past each sequence's rows (SPEC: lse_layout="padded")."""
    batch, dev = len(cu) - 1, lse.device
    padded = lse.new_full((batch, lse.shape[0], max_seqlen), float("-inf"))
    lens = torch.tensor([b - a for a, b in zip(cu, cu[1:])], dtype=torch.int64, device=dev)
    seq = torch.repeat_interleave(torch.arange(batch, device=dev), lens)
    rows = torch.arange(cu[0], cu[-1], device=dev)
    starts = torch.tensor(cu[:-1], dtype=torch.int64, device=dev)
    padded[seq, :, rows - starts[seq]] = lse[:, rows].t()
    return padded
