"""Context parallelism: one attention over a sequence sharded across the ranks of a
torch.distributed process group, forward and backward (ring attention, or K/V all-gathered).

    import torch.distributed as dist
    from hipflash.distributed import ring_flash_attn_func, shard, unshard
    q, k, v = (shard(t, dist.get_rank(), dist.get_world_size()) for t in (q, k, v))
    out = ring_flash_attn_func(q, k, v, causal=True)   # this rank's rows of the attention

Each rank holds its shard of q, k and v ([batch, seqlen / world, heads, head_dim], GQA allowed)
in one of two layouts of the full sequence, cut into chunks: "contiguous" (rank r holds chunk r
of world) or "zigzag" (rank r holds chunks r and 2 world - 1 - r of 2 world, which balances the
causal work). The result is the rank's rows of attention over the whole sequence, equal to
hipflash on the gathered sequence within SPEC §6's tolerance; the LSE merges every step's
partial result exactly (merge_attn_states, in fp32).

Transport is torch.distributed's, on any process group: point-to-point (batch_isend_irecv) for
the ring, all_gather / reduce_scatter for mode="allgather". K/V travel as raw bytes, so the
gloo backend (CPU), which refuses bfloat16 in its collectives, works too. With NCCL, keep NVLink
multicast off (NCCL_NVLS_ENABLE=0): docs/distributed.md.

Ring (mode="ring"): K/V blocks go round the ring while each rank attends to the block it holds;
the next block's transfer is in flight during the current block's attention. Backward: dK/dV
travel round the ring with their K/V and reach their owner after the last step; dQ stays local;
every step's backward uses the merged (global) out and LSE. All-gather (mode="allgather",
Llama 3's choice for GQA, where K/V are small): K/V gathered once, one attention per local
chunk, dK/dV reduce-scattered back.
"""
import numbers

import torch
import torch.distributed as dist

from . import _call, _first_order, _ops, _scale, _wants_grad, _window, merge_attn_states

LAYOUTS = ("zigzag", "contiguous")
MODES = ("ring", "allgather")

__all__ = ["ring_flash_attn_func", "shard", "unshard", "LAYOUTS", "MODES"]


# ---- Layouts ---------------------------------------------------------------------------------


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _chunk_ids(rank, world_size, layout):
    """The global chunks a rank holds, in order, and how many chunks the sequence is cut into."""
    if layout == "zigzag":
        return (rank, 2 * world_size - 1 - rank), 2 * world_size
    return (rank,), world_size


def shard(x, rank, world_size, layout="zigzag", dim=1):
    """Rank `rank`'s shard of a full-sequence tensor (the sequence along `dim`: 1 for q, k, v and
    out, 2 for an LSE [batch, heads, seqlen])."""
    _check_layout(layout)
    ids, n = _chunk_ids(rank, world_size, layout)
    if x.shape[dim] % n:
        raise ValueError(f"the sequence length {x.shape[dim]} must be a multiple of {n} "
                         f"({layout} layout over {world_size} ranks)")
    parts = x.chunk(n, dim)
    return torch.cat([parts[i] for i in ids], dim)


def unshard(shards, layout="zigzag", dim=1):
    """The full-sequence tensor from every rank's shard (a list in rank order, e.g. from
    all_gather): the inverse of shard."""
    _check_layout(layout)
    world_size = len(shards)
    n = 2 * world_size if layout == "zigzag" else world_size
    parts = [None] * n
    for rank, s in enumerate(shards):
        ids, _ = _chunk_ids(rank, world_size, layout)
        for i, p in zip(ids, s.chunk(len(ids), dim)):
            parts[i] = p
    return torch.cat(parts, dim)


# ---- Which rows see which keys ---------------------------------------------------------------

_INF = float("inf")


def _pair_call(q_off, q_len, k_off, k_len, left, right):
    """How query rows [q_off, q_off + q_len) of the global sequence attend to its keys
    [k_off, k_off + k_len) under the window (left, right) (inf: unbounded; causal is (inf, 0)),
    as one hipflash call: (q_rows, k_rows, left', right') with local row and key ranges and the
    call's window (-1 unbounded), or None when no row sees any of the keys.

    Globally key j is seen by row i when i - left <= j <= i + right (the global sequence is
    self-attention: bottom-right and top-left alignment agree). A call on q_len rows and k_len keys
    aligns bottom-right: j - i in [(k_len - q_len) - left', (k_len - q_len) + right']. Where a
    bound would be negative, the rows (or keys) past it see nothing; they are left out and the
    bound becomes 0."""
    d = q_off - k_off  # row i, key j see each other when j - i in [d - left, d + right]
    lo, hi = d - left, d + right
    if lo > k_len - 1 or hi < -(q_len - 1) or lo > hi:
        return None
    rows, keys = [0, q_len], [0, k_len]
    if lo <= -(q_len - 1) and hi >= k_len - 1:
        return tuple(rows), tuple(keys), -1, -1
    off = k_len - q_len
    new_left = left - d + off if left != _INF else None  # None: unbounded
    new_right = d + right - off if right != _INF else None
    if new_right is not None and new_right < 0:  # the last -new_right keys are seen by no row
        keys[1] += new_right
        new_left = new_left + new_right if new_left is not None else None
        new_right = 0
    elif new_left is not None and new_left < 0:  # the last -new_left rows see no key
        rows[1] += new_left
        new_right = new_right + new_left if new_right is not None else None
        new_left = 0
    return (tuple(rows), tuple(keys), -1 if new_left is None else int(new_left),
            -1 if new_right is None else int(new_right))


def _plan(rank, src, world_size, layout, chunk, left, right):
    """The calls of one step: rank's query chunks against src's key chunks. Each is (q_rows,
    k_rows, left', right') in local rows of the rank's shard and of src's shard. Query chunks
    that see a key chunk whole are joined into one call (and key chunks a query chunk sees
    whole), so a causal zigzag step is one call, as in ring-flash-attn."""
    q_ids, _ = _chunk_ids(rank, world_size, layout)
    k_ids, _ = _chunk_ids(src, world_size, layout)
    calls = {}
    for a, qi in enumerate(q_ids):
        for b, ki in enumerate(k_ids):
            c = _pair_call(qi * chunk, chunk, ki * chunk, chunk, left, right)
            if c is not None:
                rows, keys, l, r = c
                calls[(a, b)] = ((rows[0] + a * chunk, rows[1] + a * chunk),
                                 (keys[0] + b * chunk, keys[1] + b * chunk), l, r)
    nq, nk = len(q_ids), len(k_ids)
    full = {ab for ab, c in calls.items()
            if c[2:] == (-1, -1) and c[0][1] - c[0][0] == chunk and c[1][1] - c[1][0] == chunk}
    if nq * nk > 1 and len(full) == nq * nk:
        return [((0, nq * chunk), (0, nk * chunk), -1, -1)]
    for a in range(nq):  # a query chunk seeing every key chunk whole: one call
        if nk > 1 and all((a, b) in full for b in range(nk)):
            for b in range(nk):
                del calls[(a, b)]
            calls[(a, "all")] = ((a * chunk, (a + 1) * chunk), (0, nk * chunk), -1, -1)
    for b in range(nk):  # a key chunk every query chunk sees whole: one call
        if nq > 1 and all((a, b) in full and (a, b) in calls for a in range(nq)):
            for a in range(nq):
                del calls[(a, b)]
            calls[("all", b)] = ((0, nq * chunk), (b * chunk, (b + 1) * chunk), -1, -1)
    return list(calls.values())


# ---- Transport -------------------------------------------------------------------------------


def _as_bytes(tensors):
    """One flat uint8 buffer holding the tensors' bytes (any dtype: gloo refuses bfloat16)."""
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


def _from_bytes(buf, like):
    """The tensors of _as_bytes(tensors like `like`) back, as views of buf."""
    out, at = [], 0
    for t in like:
        n = t.numel() * t.element_size()
        out.append(buf[at:at + n].view(t.dtype).view(t.shape))
        at += n
    return out


class _Ring:
    """Point-to-point exchanges with the ring's neighbours (rank + 1 receives what rank sends)."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        # batch_isend_irecv takes global ranks
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world) \
            if group is not None else (self.rank + 1) % self.world
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world) \
            if group is not None else (self.rank - 1) % self.world

    def send_recv(self, buf):
        """Starts sending buf to the next rank and receiving the same size from the previous
        one; returns (works, received buffer)."""
        recv = torch.empty_like(buf)
        ops = [dist.P2POp(dist.isend, buf, self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return dist.batch_isend_irecv(ops), recv


def _wait(works):
    for w in works:
        w.wait()


# ---- The ring ---------------------------------------------------------------------------------


def _merge_into(out_acc, lse_acc, rows, out_p, lse_p):
    """Merges a step's partial result for local rows [rows) into the fp32 accumulators."""
    a, b = rows
    o, l = merge_attn_states(out_acc[:, a:b], lse_acc[:, :, a:b], out_p.float(), lse_p)
    out_acc[:, a:b] = o
    lse_acc[:, :, a:b] = l


def _bounds(causal, window_size):
    left, right = _window(window_size)
    if causal:
        right = 0
    return (_INF if left == -1 else left), (_INF if right == -1 else right)


def _ring_forward(q, k, v, scale, left, right, layout, ring):
    world, rank = ring.world, ring.rank
    b, s, h, d = q.shape
    chunk = s // len(_chunk_ids(rank, world, layout)[0])
    out_acc = torch.zeros(b, s, h, d, dtype=torch.float32, device=q.device)
    lse_acc = torch.full((b, h, s), -_INF, dtype=torch.float32, device=q.device)
    kv = (k, v)
    for step in range(world):
        src = (rank - step) % world
        if step + 1 < world:  # the next block in flight while this one is attended to
            works, recv = ring.send_recv(_as_bytes(kv))
        for rows, keys, l, r in _plan(rank, src, world, layout, chunk, left, right):
            o, lse = _call(_ops.fwd, q[:, rows[0]:rows[1]], kv[0][:, keys[0]:keys[1]],
                           kv[1][:, keys[0]:keys[1]], scale, False, l, r, 0, True)
            _merge_into(out_acc, lse_acc, rows, o, lse)
        if step + 1 < world:
            _wait(works)
            kv = tuple(_from_bytes(recv, kv))
    return out_acc.to(q.dtype), lse_acc


def _ring_backward(dout, q, k, v, out, lse, scale, left, right, layout, deterministic, ring):
    world, rank = ring.world, ring.rank
    chunk = q.shape[1] // len(_chunk_ids(rank, world, layout)[0])
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = (k, v)
    acc_works = acc_recv = None
    for step in range(world):
        src = (rank - step) % world
        if step + 1 < world:
            kv_works, kv_recv = ring.send_recv(_as_bytes(kv))
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        for rows, keys, l, r in _plan(rank, src, world, layout, chunk, left, right):
            qs, ks = slice(*rows), slice(*keys)
            g = _call(_ops.bwd, dout[:, qs].contiguous(), q[:, qs], kv[0][:, ks], kv[1][:, ks],
                      out[:, qs].contiguous(), lse[:, :, qs].contiguous(), scale, False, l, r,
                      deterministic)
            dq[:, qs] += g[0].float()
            dk[:, ks] += g[1].float()
            dv[:, ks] += g[2].float()
        if acc_works is not None:  # the block's accumulators from the ranks it visited before
            _wait(acc_works)
            prev_dk, prev_dv = _from_bytes(acc_recv, (dk, dv))
            dk += prev_dk
            dv += prev_dv
        # On to the next rank (after the last step: to the block's owner).
        acc_works, acc_recv = ring.send_recv(_as_bytes((dk, dv)))
        if step + 1 < world:
            _wait(kv_works)
            kv = tuple(_from_bytes(kv_recv, kv))
    _wait(acc_works)
    dk, dv = _from_bytes(acc_recv, (torch.empty(k.shape, dtype=torch.float32, device=q.device),
                                    torch.empty(v.shape, dtype=torch.float32, device=q.device)))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---- All-gather ------------------------------------------------------------------------------


def _gather_kv(k, v, group, world, layout):
    """The full sequence's K and V (global order) from every rank's shard."""
    buf = _as_bytes((k, v))
    bufs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    ks, vs = zip(*(_from_bytes(x, (k, v)) for x in bufs))
    return unshard(list(ks), layout), unshard(list(vs), layout)


def _allgather_calls(rank, world, layout, chunk, left, right):
    """The calls of the local query chunks against the whole (gathered) key sequence."""
    q_ids, _ = _chunk_ids(rank, world, layout)
    n = 2 * world if layout == "zigzag" else world
    calls = []
    for a, qi in enumerate(q_ids):
        c = _pair_call(qi * chunk, chunk, 0, n * chunk, left, right)
        if c is not None:
            rows, keys, l, r = c
            calls.append(((rows[0] + a * chunk, rows[1] + a * chunk), keys, l, r))
    return calls


def _allgather_forward(q, k, v, scale, left, right, layout, group, world, rank):
    kf, vf = _gather_kv(k, v, group, world, layout)
    b, s, h, d = q.shape
    chunk = s // len(_chunk_ids(rank, world, layout)[0])
    out = torch.zeros(b, s, h, d, dtype=q.dtype, device=q.device)
    lse = torch.full((b, h, s), -_INF, dtype=torch.float32, device=q.device)
    for rows, keys, l, r in _allgather_calls(rank, world, layout, chunk, left, right):
        o, ls = _call(_ops.fwd, q[:, rows[0]:rows[1]], kf[:, keys[0]:keys[1]],
                      vf[:, keys[0]:keys[1]], scale, False, l, r, 0, True)
        out[:, rows[0]:rows[1]] = o
        lse[:, :, rows[0]:rows[1]] = ls
    return out, lse


def _allgather_backward(dout, q, k, v, out, lse, scale, left, right, layout, deterministic,
                        group, world, rank):
    kf, vf = _gather_kv(k, v, group, world, layout)
    chunk = q.shape[1] // len(_chunk_ids(rank, world, layout)[0])
    dq = torch.zeros_like(q)
    dkf = torch.zeros(kf.shape, dtype=torch.float32, device=q.device)
    dvf = torch.zeros(vf.shape, dtype=torch.float32, device=q.device)
    for rows, keys, l, r in _allgather_calls(rank, world, layout, chunk, left, right):
        qs, ks = slice(*rows), slice(*keys)
        g = _call(_ops.bwd, dout[:, qs].contiguous(), q[:, qs], kf[:, ks], vf[:, ks],
                  out[:, qs].contiguous(), lse[:, :, qs].contiguous(), scale, False, l, r,
                  deterministic)
        dq[:, qs] = g[0]
        dkf[:, ks] += g[1].float()
        dvf[:, ks] += g[2].float()
    # Each rank's shard of the sum over ranks: shard in the layout, then reduce-scatter (fp32).
    parts = [_as_bytes((shard(dkf, r_, world, layout), shard(dvf, r_, world, layout)))
             for r_ in range(world)]
    mine = torch.empty_like(parts[0])
    like = (torch.empty(k.shape, dtype=torch.float32), torch.empty(v.shape, dtype=torch.float32))
    if dist.get_backend(group) == "gloo":  # gloo has no reduce_scatter: all_reduce, then take ours
        total = torch.stack([p.view(torch.float32) for p in parts])
        dist.all_reduce(total, group=group)
        mine = total[rank].view(torch.uint8)
    else:
        flat = [p.view(torch.float32) for p in parts]
        out32 = torch.empty_like(flat[0])
        dist.reduce_scatter(out32, flat, group=group)
        mine = out32.view(torch.uint8)
    dk, dv = _from_bytes(mine, like)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


# ---- The function ------------------------------------------------------------------------------


def _forward(q, k, v, scale, left, right, layout, mode, deterministic, group):
    if mode == "ring":
        return _ring_forward(q, k, v, scale, left, right, layout, _Ring(group))
    return _allgather_forward(q, k, v, scale, left, right, layout, group,
                              dist.get_world_size(group), dist.get_rank(group))


class _RingFlashAttnFunc(torch.autograd.Function):
    """ring_flash_attn_func with gradients: the forward saves (q, k, v, out, lse), the backward
    runs the same steps with the merged out and LSE."""

    @staticmethod
    def forward(ctx, q, k, v, scale, left, right, layout, mode, deterministic, group):
        out, lse = _forward(q, k, v, scale, left, right, layout, mode, deterministic, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (scale, left, right, layout, mode, deterministic, group)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        scale, left, right, layout, mode, deterministic, group = ctx.args
        with torch.no_grad():
            if mode == "ring":
                dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, scale, left, right, layout,
                                            deterministic, _Ring(group))
            else:
                dq, dk, dv = _allgather_backward(dout, q, k, v, out, lse, scale, left, right,
                                                 layout, deterministic, group,
                                                 dist.get_world_size(group), dist.get_rank(group))
        return _first_order(dq, dk, dv) + (None,) * 7


def ring_flash_attn_func(q, k, v, group=None, softmax_scale=None, causal=False,
                         window_size=(-1, -1), return_lse=False, layout="zigzag", mode="ring",
                         deterministic=False):
    """Attention over a sequence sharded across the ranks of `group` (default: the world).

    Arguments:
        q: (batch_size, seqlen_local, nheads, headdim), this rank's shard (see shard()).
        k, v: (batch_size, seqlen_local, nheads_k, headdim), the same rows' shard; nheads a
            multiple of nheads_k (GQA / MQA).
        group: a torch.distributed process group (None: the default group).
        softmax_scale, causal, window_size, deterministic: as flash_attn_func, over the global
            sequence (causal and windows by global position).
        return_lse: also return this rank's rows' LSE over the whole sequence, [batch, nheads,
            seqlen_local] fp32.
        layout: "zigzag" (default; balanced causal work) or "contiguous": how the sequence was
            sharded (shard(x, rank, world_size, layout)).
        mode: "ring" (default) or "allgather".

    Returns:
        out (batch_size, seqlen_local, nheads, headdim), and lse when return_lse.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_flash_attn_func needs an initialised torch.distributed "
                           "process group (torch.distributed.init_process_group)")
    _check_layout(layout)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, seqlen_local, heads, head_dim], got shape "
                             f"{tuple(t.shape)}")
    if k.shape[:2] != q.shape[:2] or v.shape != k.shape:
        raise ValueError("ring attention is self-attention over one sharded sequence: q, k and v "
                         f"must have the same batch and local length, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    n_chunks = 2 if layout == "zigzag" else 1
    if q.shape[1] % n_chunks:
        raise ValueError(f"the local sequence length {q.shape[1]} must be even in the zigzag "
                         "layout (two chunks per rank)")
    if not isinstance(deterministic, (bool, numbers.Integral)):
        raise TypeError("deterministic must be a bool")
    left, right = _bounds(bool(causal), window_size)
    scale = _scale(softmax_scale)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    args = (scale, left, right, layout, mode, bool(deterministic), group)
    if _wants_grad(q, k, v):
        out, lse = _RingFlashAttnFunc.apply(q, k, v, *args)
    else:
        with torch.no_grad():
            out, lse = _forward(q, k, v, *args)
    return (out, lse) if return_lse else out
