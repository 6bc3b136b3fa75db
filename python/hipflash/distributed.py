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
import contextlib
import numbers

import torch
import torch.distributed as dist

from . import _call, _first_order, _ops, _scale, _wants_grad, _window, merge_attn_states

LAYOUTS = ("zigzag", "contiguous")
MODES = ("ring", "allgather")

__all__ = ["ring_flash_attn_func", "ring_flash_attn_varlen_func", "shard", "unshard",
           "shard_varlen", "unshard_varlen", "LAYOUTS", "MODES"]


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
        one; returns (pending, received buffer). The pending exchange holds buf until _wait."""
        recv = torch.empty_like(buf)
        ops = [dist.P2POp(dist.isend, buf, self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return (dist.batch_isend_irecv(ops), buf), recv


def _wait(pending):
    """Waits for an exchange (on a GPU: makes the current stream wait for it); only then is its
    send buffer released."""
    works, _buf = pending
    for w in works:
        w.wait()


# ---- Geometry: which rows a call takes, dense or varlen ---------------------------------------


# A window bound this large reaches past any sequence: unbounded (and the planning arithmetic
# on it stays within int64).
_SATURATED = 1 << 62


def _bounds(causal, window_size):
    left, right = _window(window_size)
    if causal:
        right = 0
    return tuple(_INF if b == -1 or b >= _SATURATED else b for b in (left, right))


class _Dense:
    """Dense shards [batch, seqlen_local, heads, dim]: a call takes the same rows of every batch
    element (a slice of the sequence); LSEs [batch, heads, seqlen_local]."""

    def __init__(self, q, rank, world, layout, left, right):
        self.rank, self.world, self.layout, self.left, self.right = rank, world, layout, left, right
        self.chunk = q.shape[1] // len(_chunk_ids(rank, world, layout)[0])

    def ring_calls(self, src):
        """(rows, keys, left', right') of the step attending to rank src's block."""
        return [(slice(*rows), slice(*keys), l, r) for rows, keys, l, r in
                _plan(self.rank, src, self.world, self.layout, self.chunk, self.left, self.right)]

    def gathered_calls(self):
        """The same against the whole gathered sequence (mode="allgather")."""
        q_ids, n = _chunk_ids(self.rank, self.world, self.layout)
        calls = []
        for a, qi in enumerate(q_ids):
            c = _pair_call(qi * self.chunk, self.chunk, 0, n * self.chunk, self.left, self.right)
            if c is not None:
                rows, keys, l, r = c
                calls.append((slice(rows[0] + a * self.chunk, rows[1] + a * self.chunk),
                              slice(*keys), l, r))
        return calls

    @staticmethod
    def rows(x, idx):
        return x[:, idx]

    @staticmethod
    def lse_rows(lse, idx):
        return lse[:, :, idx]

    @staticmethod
    def set_rows(x, idx, value):
        x[:, idx] = value

    @staticmethod
    def set_lse_rows(lse, idx, value):
        lse[:, :, idx] = value

    @staticmethod
    def add_rows(x, idx, value):
        x[:, idx] += value.float()

    def new_lse(self, q):
        return torch.full((q.shape[0], q.shape[2], q.shape[1]), -_INF, dtype=torch.float32,
                          device=q.device)

    @staticmethod
    def key_rows(x, call, keys):
        return x[:, keys]

    @staticmethod
    def add_key_rows(x, call, keys, value):
        x[:, keys] += value.float()

    @staticmethod
    def fwd(q, k, v, scale, l, r, call):
        return _call(_ops.fwd, q, k, v, scale, False, l, r, 0, True)

    @staticmethod
    def bwd(dout, q, k, v, out, lse, scale, l, r, deterministic, call):
        return _call(_ops.bwd, dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(),
                     scale, False, l, r, deterministic)

    def unshard(self, shards):
        return unshard(shards, self.layout)

    def shard(self, x, rank):
        return shard(x, rank, self.world, self.layout)


class _Call:
    """One varlen call: the local rows (q_idx) and the block's keys (k_idx) it takes, as
    sequences (cu_seqlens_q / _k over the gathered rows)."""

    def __init__(self, q_ranges, k_ranges, device):
        def index(ranges):
            return torch.cat([torch.arange(a, b) for a, b in ranges]) if ranges else \
                torch.zeros(0, dtype=torch.int64)

        def cu(ranges):
            lens = [b - a for a, b in ranges]
            out = [0]
            for n in lens:
                out.append(out[-1] + n)
            return torch.tensor(out, dtype=torch.int32, device=device), max(lens, default=0)

        self.q_idx, self.k_idx = index(q_ranges).to(device), index(k_ranges).to(device)
        (self.cu_q, self.max_q), (self.cu_k, self.max_k) = cu(q_ranges), cu(k_ranges)


class _Varlen:
    """Packed shards [total_local, heads, dim] of sequences each sharded on its own
    (cu_seqlens local: the global one divided by the world size); LSEs packed [heads, total].
    A call gathers the rows it takes from every sequence that shares its window."""

    def __init__(self, q, cu_seqlens, rank, world, layout, left, right):
        self.rank, self.world, self.layout, self.left, self.right = rank, world, layout, left, right
        self.cu = [int(x) for x in cu_seqlens.tolist()]
        self.n_sub = len(_chunk_ids(rank, world, layout)[0])
        self.device = q.device
        self._calls = {}  # src rank (or "all") -> its calls, index tensors on the device
        for b in range(len(self.cu) - 1):
            if (self.cu[b + 1] - self.cu[b]) % self.n_sub:
                raise ValueError(f"sequence {b}'s local length {self.cu[b + 1] - self.cu[b]} must be "
                                 f"even in the zigzag layout (two chunks per rank)")

    def _grouped(self, per_sequence):
        """Calls from (sequence rows offset, key rows offset, [(rows, keys, l, r)]) per sequence,
        grouped by window: one varlen call per (left', right')."""
        groups = {}
        for q0, k0, calls in per_sequence:
            for rows, keys, l, r in calls:
                g = groups.setdefault((l, r), ([], []))
                g[0].append((q0 + rows[0], q0 + rows[1]))
                g[1].append((k0 + keys[0], k0 + keys[1]))
        return [(_Call(qr, kr, self.device), None, l, r) for (l, r), (qr, kr) in groups.items()]

    def ring_calls(self, src):
        if src not in self._calls:  # built once: the backward reuses the forward's
            self._calls[src] = self._ring_calls(src)
        return self._calls[src]

    def _ring_calls(self, src):
        per = []
        for b in range(len(self.cu) - 1):
            chunk = (self.cu[b + 1] - self.cu[b]) // self.n_sub
            if chunk:
                per.append((self.cu[b], self.cu[b], _plan(self.rank, src, self.world, self.layout,
                                                          chunk, self.left, self.right)))
        return self._grouped(per)

    def gathered_calls(self):
        if "all" not in self._calls:
            self._calls["all"] = self._gathered_calls()
        return self._calls["all"]

    def _gathered_calls(self):
        q_ids, n = _chunk_ids(self.rank, self.world, self.layout)
        per = []
        for b in range(len(self.cu) - 1):
            chunk = (self.cu[b + 1] - self.cu[b]) // self.n_sub
            calls = []
            for a, qi in enumerate(q_ids):
                c = _pair_call(qi * chunk, chunk, 0, n * chunk, self.left, self.right) if chunk else None
                if c is not None:
                    rows, keys, l, r = c
                    calls.append(((rows[0] + a * chunk, rows[1] + a * chunk), keys, l, r))
            per.append((self.cu[b], self.world * self.cu[b], calls))
        return self._grouped(per)

    @staticmethod
    def rows(x, call):
        return x.index_select(0, call.q_idx)

    @staticmethod
    def lse_rows(lse, call):
        return lse.index_select(1, call.q_idx)

    @staticmethod
    def set_rows(x, call, value):
        x.index_copy_(0, call.q_idx, value.to(x.dtype))

    @staticmethod
    def set_lse_rows(lse, call, value):
        lse.index_copy_(1, call.q_idx, value)

    @staticmethod
    def add_rows(x, call, value):
        x.index_add_(0, call.q_idx, value.float())

    def new_lse(self, q):
        return torch.full((q.shape[1], q.shape[0]), -_INF, dtype=torch.float32, device=q.device)

    @staticmethod
    def key_rows(x, call, keys):
        return x.index_select(0, call.k_idx)

    @staticmethod
    def add_key_rows(x, call, keys, value):
        x.index_add_(0, call.k_idx, value.float())

    @staticmethod
    def fwd(q, k, v, scale, l, r, call):
        return _call(_ops.varlen_fwd, q, k, v, call.cu_q, call.cu_k, call.max_q, call.max_k,
                     scale, False, l, r, 0, True, "packed")

    @staticmethod
    def bwd(dout, q, k, v, out, lse, scale, l, r, deterministic, call):
        return _call(_ops.varlen_bwd, dout, q, k, v, out, lse, call.cu_q, call.cu_k, call.max_q,
                     call.max_k, scale, False, l, r, deterministic, "packed")

    def unshard(self, shards):
        """The gathered packed sequences (sequence b at world * cu[b]) from every rank's."""
        return torch.cat([unshard([s[self.cu[b]:self.cu[b + 1]] for s in shards], self.layout, 0)
                          for b in range(len(self.cu) - 1)])

    def shard(self, x, rank):
        return torch.cat([shard(x[self.world * self.cu[b]:self.world * self.cu[b + 1]], rank,
                                self.world, self.layout, 0) for b in range(len(self.cu) - 1)])


def _attend(geom, call, keys, l, r, q, k, v, scale):
    """One call: its rows of q against its keys of the block k, v."""
    return geom.fwd(geom.rows(q, call), geom.key_rows(k, call, keys),
                    geom.key_rows(v, call, keys), scale, l, r, call)


def _attend_bwd(geom, call, keys, l, r, dout, q, k, v, out, lse, scale, deterministic, dk, dv):
    """One call's backward: returns dq of its rows, adds dk / dv of its keys."""
    dq, dkp, dvp = geom.bwd(geom.rows(dout, call), geom.rows(q, call),
                            geom.key_rows(k, call, keys), geom.key_rows(v, call, keys),
                            geom.rows(out, call), geom.lse_rows(lse, call), scale, l, r,
                            deterministic, call)
    geom.add_key_rows(dk, call, keys, dkp)
    geom.add_key_rows(dv, call, keys, dvp)
    return dq


# ---- The ring ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _finishing():
    """A ring loop's exchanges in flight (a list the loop keeps: _started / _done): if the loop
    raises (a call hipflash refuses; every rank refuses it alike), they are waited for before
    the error goes on, so that the process group stays usable (an exchange dropped half done
    hangs the group's next one)."""
    pending = []
    try:
        yield pending
    except BaseException:
        for works in pending:
            _wait(works)
        raise


def _done(pending, works):
    """Waits for an exchange the loop no longer holds in flight."""
    pending[:] = [p for p in pending if p is not works]
    _wait(works)


def _ring_forward(geom, q, k, v, scale, ring):
    world, rank = ring.world, ring.rank
    out_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse_acc = geom.new_lse(q)
    kv = (k, v)
    with _finishing() as pending:
        for step in range(world):
            src = (rank - step) % world
            if step + 1 < world:  # the next block in flight while this one is attended to
                works, recv = ring.send_recv(_as_bytes(kv))
                pending.append(works)
            for call, keys, l, r in geom.ring_calls(src):
                o, lse = _attend(geom, call, keys, l, r, q, kv[0], kv[1], scale)
                # Merged in fp32 into the rows' running result.
                mo, ml = merge_attn_states(geom.rows(out_acc, call),
                                           geom.lse_rows(lse_acc, call), o.float(), lse)
                geom.set_rows(out_acc, call, mo)
                geom.set_lse_rows(lse_acc, call, ml)
            if step + 1 < world:
                _done(pending, works)
                kv = tuple(_from_bytes(recv, kv))
    return out_acc.to(q.dtype), lse_acc


def _ring_backward(geom, dout, q, k, v, out, lse, scale, deterministic, ring):
    world, rank = ring.world, ring.rank
    if world == 1:  # one rank: its own block, nothing to hand on
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        for call, keys, l, r in geom.ring_calls(rank):
            geom.add_rows(dq, call, _attend_bwd(geom, call, keys, l, r, dout, q, k, v, out, lse,
                                                scale, deterministic, dk, dv))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = (k, v)
    acc_works = acc_recv = None
    with _finishing() as pending:
        for step in range(world):
            src = (rank - step) % world
            if step + 1 < world:
                kv_works, kv_recv = ring.send_recv(_as_bytes(kv))
                pending.append(kv_works)
            # The held block's dK / dV, which travel with it.
            dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
            for call, keys, l, r in geom.ring_calls(src):
                geom.add_rows(dq, call, _attend_bwd(geom, call, keys, l, r, dout, q, kv[0],
                                                    kv[1], out, lse, scale, deterministic, dk,
                                                    dv))
            if acc_works is not None:  # the block's accumulators from the ranks before
                _done(pending, acc_works)
                prev_dk, prev_dv = _from_bytes(acc_recv, (dk, dv))
                dk += prev_dk
                dv += prev_dv
            # On to the next rank (after the last step: to the block's owner).
            acc_works, acc_recv = ring.send_recv(_as_bytes((dk, dv)))
            pending.append(acc_works)
            if step + 1 < world:
                _done(pending, kv_works)
                kv = tuple(_from_bytes(kv_recv, kv))
        _done(pending, acc_works)
    dk, dv = _from_bytes(acc_recv, (torch.empty(k.shape, dtype=torch.float32),
                                    torch.empty(v.shape, dtype=torch.float32)))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---- All-gather ------------------------------------------------------------------------------


def _gather_kv(geom, k, v, group, world):
    """The whole sequence's K and V (global order) from every rank's shard."""
    buf = _as_bytes((k, v))
    bufs = [torch.empty_like(buf) for _ in range(world)]
    if buf.numel():  # (every rank's shard is as empty: gloo aborts on a 0-byte all_gather)
        dist.all_gather(bufs, buf, group=group)
    ks, vs = zip(*(_from_bytes(x, (k, v)) for x in bufs))
    return geom.unshard(list(ks)), geom.unshard(list(vs))


def _allgather_forward(geom, q, k, v, scale, group, world):
    kf, vf = _gather_kv(geom, k, v, group, world)
    out = torch.zeros_like(q)
    lse = geom.new_lse(q)
    for call, keys, l, r in geom.gathered_calls():
        o, ls = _attend(geom, call, keys, l, r, q, kf, vf, scale)
        geom.set_rows(out, call, o)
        geom.set_lse_rows(lse, call, ls)
    return out, lse


def _allgather_backward(geom, dout, q, k, v, out, lse, scale, deterministic, group, world, rank):
    kf, vf = _gather_kv(geom, k, v, group, world)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkf = torch.zeros(kf.shape, dtype=torch.float32, device=q.device)
    dvf = torch.zeros(vf.shape, dtype=torch.float32, device=q.device)
    for call, keys, l, r in geom.gathered_calls():
        geom.add_rows(dq, call, _attend_bwd(geom, call, keys, l, r, dout, q, kf, vf, out, lse,
                                            scale, deterministic, dkf, dvf))
    # Each rank's shard of the sum over ranks: reduce-scatter of the shards (fp32).
    parts = [_as_bytes((geom.shard(dkf, r_), geom.shard(dvf, r_))).view(torch.float32)
             for r_ in range(world)]
    if not parts[0].numel():  # nothing to reduce (every rank's shard is as empty)
        mine = parts[0]
    elif not parts[0].is_cuda:  # CPU tensors (gloo: no reduce_scatter): all_reduce, keep ours
        total = torch.stack(parts)
        dist.all_reduce(total, group=group)
        mine = total[rank]
    else:
        mine = torch.empty_like(parts[0])
        dist.reduce_scatter(mine, parts, group=group)
    dk, dv = _from_bytes(mine.view(torch.uint8), (torch.empty(k.shape, dtype=torch.float32),
                                                  torch.empty(v.shape, dtype=torch.float32)))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---- The functions ---------------------------------------------------------------------------


def _forward(geom, q, k, v, scale, mode, group):
    if mode == "ring":
        return _ring_forward(geom, q, k, v, scale, _Ring(group))
    return _allgather_forward(geom, q, k, v, scale, group, dist.get_world_size(group))


class _RingFlashAttnFunc(torch.autograd.Function):
    """The ring / all-gather attention with gradients: the forward saves (q, k, v, out, lse),
    the backward runs the same calls with the merged out and LSE."""

    @staticmethod
    def forward(ctx, q, k, v, geom, scale, mode, deterministic, group):
        out, lse = _forward(geom, q, k, v, scale, mode, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (geom, scale, mode, deterministic, group)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        geom, scale, mode, deterministic, group = ctx.args
        with torch.no_grad():
            if mode == "ring":
                dq, dk, dv = _ring_backward(geom, dout, q, k, v, out, lse, scale, deterministic,
                                            _Ring(group))
            else:
                dq, dk, dv = _allgather_backward(geom, dout, q, k, v, out, lse, scale,
                                                 deterministic, group, dist.get_world_size(group),
                                                 dist.get_rank(group))
        return _first_order(dq, dk, dv) + (None,) * 5


def _common_checks(q, k, v, layout, mode, deterministic, rank_dims):
    _check_initialised()
    _check_layout(layout)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank_dims:
            want = "[batch, seqlen_local, heads, head_dim]" if rank_dims == 4 else \
                "[total_local, heads, head_dim]"
            raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    if not isinstance(deterministic, (bool, numbers.Integral)):
        raise TypeError("deterministic must be a bool")


def _check_initialised():
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("hipflash.distributed needs an initialised torch.distributed process "
                           "group (torch.distributed.init_process_group)")


def _check_member(group):
    """This process takes part in group (elsewhere torch.distributed gives rank -1: the ring
    would have no step and return an empty result as an answer)."""
    if dist.get_rank(group) < 0:
        raise ValueError("this process is not a member of `group`: every rank that calls "
                         "must belong to it")


# ---- Agreement across ranks (TORCH_DISTRIBUTED_DEBUG=DETAIL) ---------------------------------


def _described(x):
    """An argument as the ranks compare it: a tensor by its dtype and shape, anything else by
    repr (a string: every rank can pickle it, and NaN equals NaN)."""
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).replace('torch.', '')} {tuple(x.shape)}"
    return repr(x)


def _resolved(resolve, arg):
    """resolve(arg) described, or arg described where it is refused (that rank's own check
    then reports it)."""
    try:
        return _described(resolve(arg))
    except Exception:  # noqa: BLE001 - any refusal: the call's own check names it
        return _described(arg)


def _call_fields(function, q, k, v, causal, window_size, softmax_scale, layout, mode,
                 deterministic, cu_seqlens=None):
    """What every rank's call must agree on: the arguments that shape the exchanges and the
    result, as the call resolves them (equal ones spelt differently agree: True and 1, an
    unbounded window as -1 or as a huge bound, the default scale given or not)."""
    tensors = [t for t in (q, k, v) if isinstance(t, torch.Tensor)]
    fields = {"function": function, "mode": _described(mode), "layout": _described(layout),
              "causal": _resolved(bool, causal),
              "window (left, right)": _resolved(lambda w: _bounds(bool(causal), w),
                                                window_size),
              "softmax_scale": _resolved(lambda s: _call_scale(s, q), softmax_scale),
              "deterministic": _resolved(bool, deterministic),
              "gradients (requires_grad under grad mode)": _described(_wants_grad(*tensors)),
              "q": _described(q), "k": _described(k), "v": _described(v)}
    if cu_seqlens is not None:
        fields["cu_seqlens"] = _resolved(torch.Tensor.tolist, cu_seqlens)
    return fields


def _agreed(group, q, fields, check):
    """check()'s result. Under TORCH_DISTRIBUTED_DEBUG=DETAIL, torch.distributed's mode for
    checking that the ranks make the same collective calls, the ranks first compare their calls
    (one all_gather_object, before anything is exchanged): a call that one rank refuses, or one
    the ranks disagree on, raises ValueError on every rank, naming the rank or the argument,
    where it would otherwise hang the group or return garbage. `fields` (a function: nothing is
    described without DETAIL) gives what is compared. Without DETAIL nothing is compared: the
    ranks must make the same call, as with any collective."""
    if dist.get_debug_level() != dist.DebugLevel.DETAIL:
        return check()
    _check_initialised()
    _check_member(group)  # outside the group, no collective to take part in
    try:
        mine, error = fields(), None
        result = check()
    except Exception as e:  # noqa: BLE001 - any error: the other ranks must hear of it
        result, error = None, e
    calls = [None] * dist.get_world_size(group)
    # NCCL stages the objects on the current CUDA device: make it q's, as the exchanges use.
    on_gpu = isinstance(q, torch.Tensor) and q.is_cuda
    with torch.cuda.device(q.device) if on_gpu else contextlib.nullcontext():
        dist.all_gather_object(calls, None if error is not None else mine, group=group)
    if error is not None:
        raise error
    refused = [r for r, theirs in enumerate(calls) if theirs is None]
    if refused:
        raise ValueError(f"rank(s) {refused} of the group refused their call (the error is "
                         "raised there); nothing was exchanged")
    for name in mine:
        values = [theirs.get(name) for theirs in calls]
        if any(value != values[0] for value in values):
            per_rank = "; ".join(f"rank {r}: {value}" for r, value in enumerate(values))
            raise ValueError(f"the ranks' calls disagree on {name} ({per_rank}); every rank of "
                             "the group must make the same call (nothing was exchanged)")
    return result


def _call_scale(softmax_scale, q):
    """The call's softmax scale: softmax_scale, or head_dim^-0.5 when None."""
    scale = _scale(softmax_scale)
    return q.shape[-1] ** -0.5 if scale is None else scale


def _run(geom, q, k, v, softmax_scale, mode, deterministic, group, return_lse):
    scale = _call_scale(softmax_scale, q)
    if _wants_grad(q, k, v):
        out, lse = _RingFlashAttnFunc.apply(q, k, v, geom, scale, mode, bool(deterministic), group)
    else:
        with torch.no_grad():
            out, lse = _forward(geom, q, k, v, scale, mode, group)
    return (out, lse) if return_lse else out


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
    def check():
        _common_checks(q, k, v, layout, mode, deterministic, 4)
        if k.shape[:2] != q.shape[:2] or v.shape != k.shape:
            raise ValueError("ring attention is self-attention over one sharded sequence: q, k "
                             "and v must have the same batch and local length, got q "
                             f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
        if layout == "zigzag" and q.shape[1] % 2:
            raise ValueError(f"the local sequence length {q.shape[1]} must be even in the "
                             "zigzag layout (two chunks per rank)")
        _check_member(group)
        left, right = _bounds(bool(causal), window_size)
        return _Dense(q, dist.get_rank(group), dist.get_world_size(group), layout, left, right)

    geom = _agreed(group, q, lambda: _call_fields("ring_flash_attn_func", q, k, v, causal,
                                                  window_size, softmax_scale, layout, mode,
                                                  deterministic), check)
    return _run(geom, q, k, v, softmax_scale, mode, deterministic, group, return_lse)


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen=None, group=None,
                                softmax_scale=None, causal=False, window_size=(-1, -1),
                                return_lse=False, layout="zigzag", mode="ring",
                                deterministic=False):
    """ring_flash_attn_func for packed sequences of different lengths, ring-flash-attn's
    convention: every sequence is sharded on its own (shard_varlen), so each rank holds the
    same local cu_seqlens, the global one divided by the world size.

    Arguments:
        q: (total_local, nheads, headdim); k, v: (total_local, nheads_k, headdim).
        cu_seqlens: (batch_size + 1,) int32, the local prefix sums (each local length even in
            the zigzag layout).
        max_seqlen: the longest local length (accepted for FlashAttention's signature; derived
            from cu_seqlens).
        The rest as ring_flash_attn_func.

    Returns:
        out (total_local, nheads, headdim), and lse (nheads, total_local) fp32 when return_lse.
    """
    def check():
        _common_checks(q, k, v, layout, mode, deterministic, 3)
        if k.shape[0] != q.shape[0] or v.shape != k.shape:
            raise ValueError("q, k and v must hold the same local rows: got q "
                             f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or \
                cu_seqlens.numel() < 1 or cu_seqlens.dtype != torch.int32:
            raise ValueError("cu_seqlens must be a 1-d int32 tensor of batch_size + 1 prefix "
                             "sums, got "
                             f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)}")
        _check_member(group)
        left, right = _bounds(bool(causal), window_size)
        geom = _Varlen(q, cu_seqlens, dist.get_rank(group), dist.get_world_size(group), layout,
                       left, right)
        if geom.cu[0] != 0 or geom.cu[-1] != q.shape[0] or any(
                a > b for a, b in zip(geom.cu, geom.cu[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to the {q.shape[0]} local rows, got "
                             f"{geom.cu[:8]}{'...' if len(geom.cu) > 8 else ''}")
        return geom

    geom = _agreed(group, q, lambda: _call_fields("ring_flash_attn_varlen_func", q, k, v,
                                                  causal, window_size, softmax_scale, layout,
                                                  mode, deterministic, cu_seqlens), check)
    return _run(geom, q, k, v, softmax_scale, mode, deterministic, group, return_lse)


def shard_varlen(x, cu_seqlens, rank, world_size, layout="zigzag"):
    """Rank `rank`'s rows of packed sequences x [total, ...] (global cu_seqlens): each sequence
    sharded on its own. The rank's cu_seqlens are cu_seqlens // world_size."""
    cu = [int(c) for c in cu_seqlens.tolist()]
    return torch.cat([shard(x[a:b], rank, world_size, layout, 0) for a, b in zip(cu, cu[1:])])


def unshard_varlen(shards, cu_seqlens, layout="zigzag"):
    """The packed sequences from every rank's shard_varlen rows (global cu_seqlens)."""
    world = len(shards)
    cu = [int(c) // world for c in cu_seqlens.tolist()]
    return torch.cat([unshard([s[a:b] for s in shards], layout, 0) for a, b in zip(cu, cu[1:])])
