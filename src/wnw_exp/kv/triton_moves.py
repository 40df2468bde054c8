"""Triton kernels of the packed store's moves: two launches apply a flush, of one store or of a batch's stores
together (`PackedAudioKVStore.flush`'s PyTorch code, the specification, is some 35 small kernels per store), and
the GPU reads the recalled rows from the pinned host mirror itself (zero-copy over PCIe: no host thread, no
staging buffer), so a CUDA graph can hold the whole move.

`FlushTables`: the flush of one or several stores (a batch's streams) in two launches, the stores' tensors found
through a table of their addresses. The first launch has one program per head (row) that can move, on device
memory only. It first checks the row's two queues: a row with nothing queued stops there (no slot scans, no
writes). Recalls first: the row's recalled positions (queued, not resident), ascending, go to its free slots
(position -1), ascending; what finds no free slot is counted in `overflow`; each (host mirror row, slot) pair is
appended to one list for all the rows (an atomic counter). Then releases free the slots of the queued positions;
the row's resident count and scan length (one past its highest occupied slot) are rebuilt and its queues cleared.
The second launch copies the listed K/V rows from the host mirror as 16-bit words (whatever the dtype), a fixed
grid walking the list a grid-stride apart: its work follows the pairs that move, many reads in flight over PCIe,
and its last program empties the list (a slot a release freed in the same flush may receive its rows: it holds no
position, so nothing attends to it). Fixed grids, no host read: a CUDA graph can hold both launches.
`queue_segments`: recalls and releases chosen per segment (WnW's chunk swap), both queued in one launch;
`SegmentQueueTables`: the same for several stores (a batch's streams) in one launch. `queue_pages`: recalls and
releases chosen per (head, page) (ArkVale's swap) in one launch.
`gather_layout` / `advance_layout`: a batch's attention metadata gathered from its stores, and their lengths
advanced, in one launch each (`kv.packed.BatchLayout`).
`RecordTables`: a decode step's accounting (resident tokens, rows recalled so far) of one or several stores in one
launch.
`read_host`: one element of pinned host memory, the store's probe that the GPU can read it.
Import this module only where `triton` is installed; on a CPU set TRITON_INTERPRET=1 before importing.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

from wnw_exp.kv.base import upload

SCAN = 1024  # positions or slots per iteration of a row's scans
# The copy's fixed grid (at most COPY_PROGRAMS programs, each walking the pair list's tiles of COPY pairs a
# grid-stride apart). Measured on the H200 (2026-12-02, docs/gpu.md): ArkVale at bs 1 (19.7 MB of recalls a step)
# 4.34 / 4.34 / 4.43 ms a token with 2048 x 16 / 4096 x 8 / 1024 x 32 (256 x 64: 7.15; Full 3.00); 2048 x 16 it is.
# WNW_COPY_GRID=PROGRAMSxPAIRS picks another for a timing sweep.
COPY_PROGRAMS, COPY = (int(x) for x in os.environ.get("WNW_COPY_GRID", "2048x16").split("x"))

# The fields of a store's row in `FlushTables.ptrs` (addresses, and its audio length N last).
_REC, _REL, _SLOT_OF, _POS, _BASE, _CAP, _N_RES, _ALEN, _HK, _HV, _AK, _AV, _OVERFLOW, _RECALLED, _N = (
    tl.constexpr(j) for j in range(15))
NF = 15  # (Python's; the kernels read `_NF`: a plain global int is not a constant to the Triton compiler)
_NF = tl.constexpr(NF)
FIELDS = ("queued_recall", "queued_release", "slot_of", "audio_pos", "_offsets", "_caps", "n_resident", "audio_len",
          "host_k", "host_v", "audio_k", "audio_v", "overflow", "_recalled")
assert len(FIELDS) + 1 == NF


@triton.jit
def table_field(tbl, s, j: tl.constexpr, ty: tl.constexpr, NF: tl.constexpr = _NF):
    """The tensor `j` (a pointer to `ty`) of the entries `s` (a scalar or a vector of indices), in a table of rows
    of NF fields (`FlushTables.ptrs` by default; `SegmentQueueTables` and `triton_swap.ChunkSwapTables` pass their
    own NF): the address-table lookup of every multi-stream launch."""
    return tl.load(tbl + s * NF + j).to(tl.pointer_type(ty))


class AddressRows:
    """A multi-stream launch's address table: rows of `nf` int64 fields (tensor addresses and sizes, one row per
    stream) in one device tensor made once and rewritten in place (`write`); rows past the streams' are zero (the
    kernels skip them). Made for `n_streams` streams, or, with a `capacity`, for up to that many: then `n` (the
    launch's programs, one a row) stays the capacity, so that a CUDA graph captured over the launch follows any new
    set of streams; without, `n` is the rows written. The tensors whose addresses it holds are kept alive until the
    next write."""

    def __init__(self, n_streams: int, nf: int, device: torch.device, capacity: int | None = None):
        self.fixed = capacity is not None
        self.capacity, self.nf = max(int(capacity if self.fixed else n_streams), 1), nf
        self.ptrs = torch.zeros(self.capacity, nf, dtype=torch.int64, device=device)
        self.n = self.capacity if self.fixed else 0
        self._keep: list = []

    def write(self, rows: list, keep: list) -> None:
        """Rows `rows` (lists of nf ints) from the first, zeros after (outside a graph capture)."""
        if len(rows) > self.capacity:
            raise ValueError(f"{len(rows)} rows for an address table of {self.capacity}")
        host = torch.zeros(self.capacity, self.nf, dtype=torch.int64)
        if rows:
            host[: len(rows)] = torch.tensor(rows, dtype=torch.int64)
        upload(self.ptrs, host)
        self._keep = list(keep)
        self.n = self.capacity if self.fixed else len(rows)


@triton.jit
def _flush_kernel(tbl, row_st_ptr, row_r_ptr, row_m_ptr, scr_off_ptr, scratch_ptr, pair_st_ptr, pair_src_ptr,
                  pair_dst_ptr, cnt_ptr, SCAN: tl.constexpr):
    i = tl.program_id(0)
    st = tl.load(row_st_ptr + i)
    if st >= 0:  # (a row of a table made for more streams than it holds: nothing)
        r = tl.load(row_r_ptr + i).to(tl.int64)
        rec_ptr, rel_ptr = table_field(tbl, st, _REC, tl.int8), table_field(tbl, st, _REL, tl.int8)
        slot_of_ptr, pos_ptr = table_field(tbl, st, _SLOT_OF, tl.int32), table_field(tbl, st, _POS, tl.int32)
        N = tl.load(tbl + st * _NF + _N)
        base = tl.load(table_field(tbl, st, _BASE, tl.int32) + r).to(tl.int64)
        cap = tl.load(table_field(tbl, st, _CAP, tl.int32) + r).to(tl.int64)
        scr = scratch_ptr + tl.load(scr_off_ptr + i)  # this row's scratch: its recalled positions, cap of them at most
        lane = tl.arange(0, SCAN)
        row_n = r * N
        mirror_n = tl.load(row_m_ptr + i).to(tl.int64) * N  # the row's first element in the host mirror, in rows
        # 1a. the recalled positions (queued, not resident), ascending, into the scratch (those past `cap` cannot find a
        # free slot: only counted); and whether anything is queued on the row at all (else nothing below runs)
        n_rec = 0
        n_queued = 0
        for p0 in range(0, N, SCAN):
            p = p0 + lane
            m = p < N
            rec = tl.load(rec_ptr + row_n + p, mask=m, other=0) != 0
            rel = tl.load(rel_ptr + row_n + p, mask=m, other=0) != 0
            want = rec & (tl.load(slot_of_ptr + row_n + p, mask=rec, other=0) < 0)
            k = n_rec + tl.cumsum(want.to(tl.int32), 0) - 1
            tl.store(scr + k, p, mask=want & (k < cap))
            n_rec += tl.sum(want.to(tl.int32), 0)
            n_queued += tl.sum((rec | rel).to(tl.int32), 0)
        busy = n_queued > 0
        cap_b = tl.where(busy, cap, 0)
        tl.debug_barrier()
        # 1b. the k-th free slot takes the k-th recalled position; the (host row, slot) pair is appended to the list
        # that _copy_list_kernel walks
        n_free = 0
        for s0 in range(0, cap_b, SCAN):
            s = s0 + lane
            m = s < cap
            free = m & (tl.load(pos_ptr + base + s, mask=m, other=0) < 0)
            k = n_free + tl.cumsum(free.to(tl.int32), 0) - 1
            fill = free & (k < n_rec)
            p = tl.load(scr + k, mask=fill, other=0)
            at = tl.atomic_add(cnt_ptr, tl.sum(fill.to(tl.int32), 0)) + k - n_free  # the fills' places in the list
            tl.store(pair_st_ptr + at, tl.zeros([SCAN], tl.int32) + st, mask=fill)
            tl.store(pair_src_ptr + at, (mirror_n + p).to(tl.int32), mask=fill)
            tl.store(pair_dst_ptr + at, (base + s).to(tl.int32), mask=fill)
            tl.store(pos_ptr + base + s, p, mask=fill)
            tl.store(slot_of_ptr + row_n + p, s.to(tl.int32), mask=fill)
            n_free += tl.sum(free.to(tl.int32), 0)
        tl.atomic_add(table_field(tbl, st, _OVERFLOW, tl.int64), tl.maximum(n_rec - n_free, 0).to(tl.int64), mask=busy)
        tl.atomic_add(table_field(tbl, st, _RECALLED, tl.int64), tl.minimum(n_rec, n_free).to(tl.int64), mask=busy)
        tl.debug_barrier()
        # 2. releases, and the row's resident count and scan length (rebuilt where anything was queued)
        n_res = 0
        high = 0
        for s0 in range(0, cap_b, SCAN):
            s = s0 + lane
            m = s < cap
            pv = tl.load(pos_ptr + base + s, mask=m, other=-1)
            occ = pv >= 0
            gone = occ & (tl.load(rel_ptr + row_n + pv, mask=occ, other=0) != 0)
            tl.store(pos_ptr + base + s, tl.full([SCAN], -1, tl.int32), mask=gone)
            tl.store(slot_of_ptr + row_n + pv, tl.full([SCAN], -1, tl.int32), mask=gone)
            keep = occ & ~gone
            n_res += tl.sum(keep.to(tl.int32), 0)
            high = tl.maximum(high, tl.max(tl.where(keep, (s + 1).to(tl.int32), 0), 0))
        tl.store(table_field(tbl, st, _N_RES, tl.int64) + r, n_res.to(tl.int64), mask=busy)
        tl.store(table_field(tbl, st, _ALEN, tl.int32) + r, high.to(tl.int32), mask=busy)
        for p0 in range(0, tl.where(busy, N, 0), SCAN):
            p = p0 + lane
            m = p < N
            tl.store(rec_ptr + row_n + p, tl.zeros([SCAN], tl.int8), mask=m)
            tl.store(rel_ptr + row_n + p, tl.zeros([SCAN], tl.int8), mask=m)


@triton.jit
def _copy_list_kernel(tbl, pair_st_ptr, pair_src_ptr, pair_dst_ptr, cnt_ptr, W: tl.constexpr, COPY: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    n = tl.load(cnt_ptr)
    cols = tl.arange(0, W)
    for t0 in range(pid * COPY, n, G * COPY):
        k = t0 + tl.arange(0, COPY)
        m = k < n
        st = tl.load(pair_st_ptr + k, mask=m, other=0)
        src = tl.load(pair_src_ptr + k, mask=m, other=0).to(tl.int64)[:, None] * W + cols[None, :]
        dst = tl.load(pair_dst_ptr + k, mask=m, other=0).to(tl.int64)[:, None] * W + cols[None, :]
        m2 = m[:, None]
        # both host reads are issued before either store, so a tile has K's and V's reads in flight together
        k_rows = tl.load(table_field(tbl, st, _HK, tl.int16)[:, None] + src, mask=m2)
        v_rows = tl.load(table_field(tbl, st, _HV, tl.int16)[:, None] + src, mask=m2)
        tl.store(table_field(tbl, st, _AK, tl.int16)[:, None] + dst, k_rows, mask=m2)
        tl.store(table_field(tbl, st, _AV, tl.int16)[:, None] + dst, v_rows, mask=m2)
    # the last program to finish empties the list for the next flush (every program has read n by then)
    tl.debug_barrier()
    last = tl.atomic_add(cnt_ptr + 1, 1) == G - 1
    tl.store(cnt_ptr, 0, mask=last)
    tl.store(cnt_ptr + 1, 0, mask=last)


class FlushTables:
    """The queued moves of several packed stores (`kv.packed.PackedAudioKVStore`) applied in two launches, the
    flush of one store being a table of one (see the module docstring). `parts`: (store, its rows that can move,
    a host int array) per store; the stores' tensors are separate allocations, so their addresses are in a table
    (`ptrs`, one row of `FIELDS` per store, as `ObserverSum` does): made outside any graph capture. Every store's
    K/V must have the same row size in 16-bit words (`W`: the copy moves words, whatever the dtype).

    Without `capacity` the tables fit `parts` exactly (rebuild them when the set of stores or a store's layout
    changes). With `capacity` they hold up to that many stores, each with up to all its rows, and `bind` rewrites
    them in place for another set of stores (the launches' grids stay fixed: a graph captured over them replays for
    any set they can hold); `bind` says False where a set does not fit (more scratch than was sized)."""

    def __init__(self, parts: list, device: torch.device, capacity: int | None = None):
        self.capacity, self.device = capacity, device
        slots = [int(st.caps[np.asarray(rows, np.int64)].sum()) for st, rows in parts]
        if capacity is None:
            n_st, row_cap, slot_cap = len(parts), sum(len(rows) for _, rows in parts), sum(slots)
        else:
            n_st = capacity
            row_cap = capacity * max((st.n_rows for st, _ in parts), default=1)
            slot_cap = capacity * triton.next_power_of_2(max(slots + [1]))
        self.table = AddressRows(n_st, NF, device)
        self.ptrs = self.table.ptrs
        self.W = None
        self.row_cap, self.slot_cap = max(row_cap, 1), max(slot_cap, 1)
        i32 = lambda n: torch.empty(n, dtype=torch.int32, device=device)  # noqa: E731
        # each flushed row's store, row and host mirror row (one upload in `bind`), and its scratch offset
        self._cols = torch.empty(3, self.row_cap, dtype=torch.int32, device=device)
        self.row_st, self.row_r, self.row_m = self._cols
        self.scr_off = torch.empty(self.row_cap, dtype=torch.int64, device=device)
        self.scratch = i32(self.slot_cap)
        # the pairs to copy: store, host mirror row (its mirror row * N + position), slot (16 bytes a slot with the
        # scratch)
        self.pair_st, self.pair_src, self.pair_dst = i32(self.slot_cap), i32(self.slot_cap), i32(self.slot_cap)
        self.count = torch.zeros(2, dtype=torch.int32, device=device)  # pairs listed; copy programs done
        self.copy_programs = min(COPY_PROGRAMS, triton.cdiv(self.slot_cap, COPY))
        if not self.bind(parts):
            raise AssertionError("FlushTables: the parts do not fit tables made for them")

    def bind(self, parts: list) -> bool:
        """Rewrite the tables for `parts` (outside a graph capture); False (nothing changed) where they do not fit."""
        ptrs, keep, words = [], [], set()
        for store, rows in parts:
            ts = [getattr(store, f) for f in FIELDS]
            assert all(t.is_contiguous() for t in ts)
            assert store.audio_k.element_size() in (2, 4, 8) and store.host_k.dtype == store.audio_k.dtype
            words.add(store.head_dim * store.audio_k.element_size() // 2)
            assert store.n_rows * store.n_audio < 2**31 and store.audio_k.shape[0] < 2**31  # int32 pairs
            keep += ts
            ptrs.append([t.data_ptr() for t in ts] + [store.n_audio])
        rows = [np.asarray(r, np.int64) for _, r in parts]
        cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64)  # noqa: E731
        row_r = cat(rows)
        row_st = np.repeat(np.arange(len(parts), dtype=np.int64), [len(r) for r in rows])
        row_m = cat([store.host_row[r] for (store, _), r in zip(parts, rows)])  # each row's row in the host mirror
        slots = cat([store.caps[r] for (store, _), r in zip(parts, rows)])  # a row's recalls fill at most its slots
        scr_off = np.cumsum(slots) - slots
        n_slots = int(slots.sum())
        assert len(words) <= 1, "FlushTables: the stores' K/V rows differ in size"
        W = words.pop() if words else (self.W or 1)
        assert W & (W - 1) == 0, "the K/V row size in 16-bit words must be a power of two"
        if (len(parts) > self.table.capacity or len(row_r) > self.row_cap or n_slots > self.slot_cap
                or (self.W is not None and W != self.W)):
            return False
        self.W = W
        self.table.write(ptrs, keep)
        pad = self.row_cap - len(row_r) if self.capacity is not None else 0
        self.n_store_rows = len(row_r)  # the stores' rows it flushes
        self.n_rows = len(row_r) + pad  # (with a capacity, the fixed grid: rows past the stores' are skipped)
        if self.n_rows:  # (rows past the stores': store -1)
            cols = np.zeros((3, self.n_rows), np.int32)
            cols[0, len(row_r):] = -1
            cols[:, : len(row_r)] = (row_st, row_r, row_m)
            upload(self._cols[:, : self.n_rows], torch.from_numpy(cols))
            upload(self.scr_off[: self.n_rows], torch.from_numpy(np.pad(scr_off, (0, pad))))
        return True

    def __call__(self) -> None:
        if self.n_rows == 0:
            return
        self.flush()
        self.copy()

    def flush(self) -> None:
        """The first launch: the moves, the recalled pairs listed (`__call__` runs both launches)."""
        _flush_kernel[(self.n_rows,)](self.ptrs, self.row_st, self.row_r, self.row_m, self.scr_off, self.scratch,
                                      self.pair_st, self.pair_src, self.pair_dst, self.count, SCAN=SCAN)

    def copy(self) -> None:
        """The second launch: the listed pairs copied, the list emptied."""
        _copy_list_kernel[(self.copy_programs,)](self.ptrs, self.pair_st, self.pair_src, self.pair_dst, self.count,
                                                 W=self.W, COPY=COPY)


@triton.jit
def _queue_pairs_kernel(r_ptr, p_ptr, sel_ptr, slot_of_ptr, on_host_ptr, q_ptr, n, N, RECALL: tl.constexpr,
                        HAS_SEL: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    flat = tl.load(r_ptr + i, mask=m, other=0).to(tl.int64) * N + tl.load(p_ptr + i, mask=m, other=0)
    go = m & (tl.load(on_host_ptr + flat, mask=m, other=0) != 0)
    if HAS_SEL:
        go = go & (tl.load(sel_ptr + i, mask=m, other=0) != 0)
    slot = tl.load(slot_of_ptr + flat, mask=go, other=0)
    if RECALL:
        go = go & (slot < 0)
    else:
        go = go & (slot >= 0)
    tl.store(q_ptr + flat, tl.full([BLOCK], 1, tl.int8), mask=go)


def queue_pairs(recall: bool, rows: torch.Tensor, pos: torch.Tensor, select: torch.Tensor | None,
                slot_of: torch.Tensor, on_host: torch.Tensor, queue: torch.Tensor) -> None:
    """What the packed store's `recall` (recall=True) or `release` queues inside a graph capture, in one launch:
    for each (row, position) pair (distinct) that is selected and has a host copy, mark it in `queue` (R, N) bool
    where it is not resident (recall) or resident (release). rows/pos (n,) integer, select (n,) bool or None."""
    n, N = pos.numel(), slot_of.shape[1]
    rows, pos = rows.contiguous(), pos.contiguous()
    for t in (slot_of, on_host, queue):
        assert t.is_contiguous()
    if n == 0:
        return
    sel = select.contiguous().view(torch.int8) if select is not None else pos
    BLOCK = 1024
    _queue_pairs_kernel[(triton.cdiv(n, BLOCK),)](rows, pos, sel, slot_of, on_host.view(torch.int8),
                                                  queue.view(torch.int8), n, N, RECALL=recall,
                                                  HAS_SEL=select is not None, BLOCK=BLOCK)


@triton.jit
def _queue_segments_block(r_ptr, p_ptr, seg_ptr, rec_mask_ptr, rel_mask_ptr, slot_of_ptr, on_host_ptr, qrec_ptr,
                          qrel_ptr, blk, n, N, BLOCK: tl.constexpr):
    """Block `blk` of BLOCK pairs of one store's `queue_segments` (the direct kernel and `SegmentQueueTables`'s
    both run it)."""
    i = blk * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    flat = tl.load(r_ptr + i, mask=m, other=0).to(tl.int64) * N + tl.load(p_ptr + i, mask=m, other=0)
    host = m & (tl.load(on_host_ptr + flat, mask=m, other=0) != 0)
    sg = tl.load(seg_ptr + i, mask=host, other=0)
    resident = tl.load(slot_of_ptr + flat, mask=host, other=0) >= 0
    rec = host & (tl.load(rec_mask_ptr + sg, mask=host, other=0) != 0) & ~resident
    rel = host & (tl.load(rel_mask_ptr + sg, mask=host, other=0) != 0) & resident
    tl.store(qrec_ptr + flat, tl.full([BLOCK], 1, tl.int8), mask=rec)
    tl.store(qrel_ptr + flat, tl.full([BLOCK], 1, tl.int8), mask=rel)


@triton.jit
def _queue_segments_kernel(r_ptr, p_ptr, seg_ptr, rec_mask_ptr, rel_mask_ptr, slot_of_ptr, on_host_ptr, qrec_ptr,
                           qrel_ptr, n, N, BLOCK: tl.constexpr):
    _queue_segments_block(r_ptr, p_ptr, seg_ptr, rec_mask_ptr, rel_mask_ptr, slot_of_ptr, on_host_ptr, qrec_ptr,
                          qrel_ptr, tl.program_id(0), n, N, BLOCK)


# The fields of a store's row in `SegmentQueueTables.ptrs`: its pairs (rows, positions, segments) and the decision's
# masks (recall, release), its bookkeeping, then the number of pairs and the store's audio length.
(_Q_ROWS, _Q_POS, _Q_SEG, _Q_RECALL, _Q_RELEASE, _Q_SLOT_OF, _Q_ON_HOST, _Q_QREC, _Q_QREL, _Q_NPAIRS, _Q_N) = (
    tl.constexpr(j) for j in range(11))
QNF = 11
_QNF = tl.constexpr(QNF)
QUEUE_FIELDS = ("slot_of", "on_host", "queued_recall", "queued_release")


@triton.jit
def _segment_queue_tables_kernel(tbl, BLOCK: tl.constexpr):
    """Blocks program_id(0), + num_programs(0), ... of store program_id(1)'s pairs: its `queue_segments`."""
    st = tl.program_id(1)
    n = tl.load(tbl + st * _QNF + _Q_NPAIRS)
    for blk in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
        _queue_segments_block(table_field(tbl, st, _Q_ROWS, tl.int64, _QNF),
                              table_field(tbl, st, _Q_POS, tl.int64, _QNF),
                              table_field(tbl, st, _Q_SEG, tl.int64, _QNF),
                              table_field(tbl, st, _Q_RECALL, tl.int8, _QNF),
                              table_field(tbl, st, _Q_RELEASE, tl.int8, _QNF),
                              table_field(tbl, st, _Q_SLOT_OF, tl.int32, _QNF),
                              table_field(tbl, st, _Q_ON_HOST, tl.int8, _QNF),
                              table_field(tbl, st, _Q_QREC, tl.int8, _QNF),
                              table_field(tbl, st, _Q_QREL, tl.int8, _QNF), blk, n,
                              tl.load(tbl + st * _QNF + _Q_N), BLOCK)


class SegmentQueueTables:
    """`PackedAudioKVStore.queue_segments` of several stores (a batch's streams, each with a method's per-segment
    recall and release masks) in one launch; one store is a table of one. `parts`: (store, (rows, positions,
    segments) int64 pairs, recall (n_seg,) bool, release (n_seg,) bool) per store. The tensors' addresses are in a
    table (`ptrs`, rows of QNF fields): made outside any graph capture, rebuilt when `key` changes (compare
    `SegmentQueueTables.key_of(parts)`), or, made with a `capacity` (stores), rewritten in place by `bind` for
    another set (a fixed grid, whose programs walk their stores' pairs a grid-stride apart); the tensors are kept
    alive here."""

    BLOCK = 1024

    def __init__(self, parts: list, device: torch.device, capacity: int | None = None):
        self.table = AddressRows(len(parts), QNF, device, capacity)
        self.ptrs = self.table.ptrs
        self.capacity = capacity
        # programs per store: one per block of the longest pair list it is made for (longer ones loop)
        self.blocks = triton.cdiv(max((pairs[1].numel() for _, pairs, _, _ in parts), default=0), self.BLOCK)
        if capacity is not None:
            self.blocks = max(self.blocks, 1)
        self.bind(parts)

    n = property(lambda self: self.table.n)  # the launch's programs (streams)

    def bind(self, parts: list) -> bool:
        """Rewrite the table for `parts` (outside a graph capture); False where there are more than it holds."""
        if len(parts) > self.table.capacity:
            return False
        rows, keep = [], []
        for store, (p_rows, p_pos, p_seg), recall, release in parts:
            assert all(x.dtype == torch.int64 for x in (p_rows, p_pos, p_seg)) and store.slot_of.dtype == torch.int32
            assert recall.dtype == torch.bool and release.dtype == torch.bool
            ts = [p_rows, p_pos, p_seg, recall, release] + [getattr(store, f) for f in QUEUE_FIELDS]
            assert all(x.is_contiguous() for x in ts)
            keep += ts
            rows.append([x.data_ptr() for x in ts] + [p_pos.numel(), store.slot_of.shape[1]])
        self.table.write(rows, keep)
        self.key = self.key_of(parts)
        return True

    @staticmethod
    def key_of(parts: list) -> list:
        """What the tables were built from (every tensor's address): a part that changes needs new tables."""
        return [x.data_ptr() for store, pairs, recall, release in parts
                for x in (*pairs, recall, release, *(getattr(store, f) for f in QUEUE_FIELDS))]

    def __call__(self) -> None:
        if self.blocks and self.table.n:
            _segment_queue_tables_kernel[(self.blocks, self.table.n)](self.ptrs, BLOCK=self.BLOCK)


def queue_segments(rows: torch.Tensor, pos: torch.Tensor, seg: torch.Tensor, recall: torch.Tensor,
                   release: torch.Tensor, slot_of: torch.Tensor, on_host: torch.Tensor, queued_recall: torch.Tensor,
                   queued_release: torch.Tensor) -> None:
    """`queue_pairs` for recalls and releases chosen per segment, in one launch: pair i = (rows[i], pos[i]) of
    segment seg[i] is queued for recall where recall[seg[i]] (and it has a host copy and is not resident) and for
    release where release[seg[i]] (a host copy, resident). recall/release (n_seg,) bool."""
    n, N = pos.numel(), slot_of.shape[1]
    for t in (rows, pos, seg, recall, release, slot_of, on_host, queued_recall, queued_release):
        assert t.is_contiguous()
    if n == 0:
        return
    BLOCK = 1024
    i8 = lambda x: x.view(torch.int8)  # noqa: E731
    _queue_segments_kernel[(triton.cdiv(n, BLOCK),)](rows, pos, seg, i8(recall), i8(release), slot_of, i8(on_host),
                                                     i8(queued_recall), i8(queued_release), n, N, BLOCK=BLOCK)


@triton.jit
def _queue_pages_kernel(codes_ptr, codes_stride, page_of_ptr, on_host_ptr, slot_of_ptr, qrec_ptr, qrel_ptr, row0, N,
                        BLOCK: tl.constexpr):
    """Row row0 + program_id(0): every position of a page coded 1 queued for recall (a host copy, not resident), of a
    page coded 2 for release (a host copy, resident)."""
    h = tl.program_id(0)
    row = (row0 + h).to(tl.int64) * N
    for n0 in range(0, N, BLOCK):
        pos = n0 + tl.arange(0, BLOCK)
        m = pos < N
        code = tl.load(codes_ptr + h * codes_stride + tl.load(page_of_ptr + pos, mask=m, other=0), mask=m, other=0)
        host = m & (tl.load(on_host_ptr + row + pos, mask=m, other=0) != 0)
        resident = tl.load(slot_of_ptr + row + pos, mask=host, other=-1) >= 0
        tl.store(qrec_ptr + row + pos, tl.full([BLOCK], 1, tl.int8), mask=host & (code == 1) & ~resident)
        tl.store(qrel_ptr + row + pos, tl.full([BLOCK], 1, tl.int8), mask=host & (code == 2) & resident)


def queue_pages(codes: torch.Tensor, page_of: torch.Tensor, row0: int, slot_of: torch.Tensor, on_host: torch.Tensor,
                queued_recall: torch.Tensor, queued_release: torch.Tensor) -> None:
    """Recalls and releases chosen per (row, page) in one launch, one program per row: codes (R, >= n_pages) int8
    for rows row0 .. row0 + R - 1 (1 recall, 2 release), page_of (N,) int64 each position's page."""
    assert codes.stride(1) == 1 and page_of.is_contiguous() and slot_of.is_contiguous()
    _queue_pages_kernel[(codes.shape[0],)](codes, codes.stride(0), page_of, on_host.view(torch.int8), slot_of,
                                           queued_recall.view(torch.int8), queued_release.view(torch.int8), row0,
                                           slot_of.shape[1], BLOCK=1024)


@triton.jit
def _record_step_kernel(tbl, BLOCK: tl.constexpr):
    st = tl.program_id(0)
    R = tl.load(tbl + st * 6 + 5)
    if R > 0:  # (a row of a table made for more stores than it holds: nothing)
        n_res_ptr = table_field(tbl, st, 0, tl.int64, 6)
        total = tl.zeros([BLOCK], tl.int64)
        for r0 in range(0, R, BLOCK):
            r = r0 + tl.arange(0, BLOCK)
            total += tl.load(n_res_ptr + r, mask=r < R, other=0)
        n_rec_ptr = table_field(tbl, st, 2, tl.int64, 6)
        at = tl.load(n_rec_ptr)
        tl.store(table_field(tbl, st, 3, tl.int64, 6) + at, tl.sum(total, 0))
        tl.store(table_field(tbl, st, 4, tl.int64, 6) + at, tl.load(table_field(tbl, st, 1, tl.int64, 6)))
        tl.store(n_rec_ptr, at + 1)


RECORD_FIELDS = ("n_resident", "_recalled", "_n_rec", "_rec_n_gpu", "_rec_rows")


class RecordTables:
    """`PackedAudioKVStore.record_step` of several stores (a batch's streams) in one launch, one program per store
    (one store: a table of one): at step n_rec, the resident audio tokens (the sum of n_resident (R,) int64) and
    the rows recalled so far (`_recalled`, () int64); then n_rec += 1. The stores' tensors' addresses are in a
    table (`ptrs`, rows of RECORD_FIELDS and R): made outside any graph capture, rebuilt when `key` changes, or,
    made with a `capacity` (stores), rewritten in place by `bind` for another set (a fixed grid)."""

    def __init__(self, stores: list, device: torch.device, capacity: int | None = None):
        self.capacity = capacity
        self.table = AddressRows(len(stores), 6, device, capacity)
        self.ptrs = self.table.ptrs
        self.bind(stores)

    n = property(lambda self: self.table.n)  # the launch's programs (streams)

    def bind(self, stores: list) -> bool:
        """Rewrite the table for `stores` (outside a graph capture); False where there are more than it holds."""
        if len(stores) > self.table.capacity:
            return False
        rows, keep = [], []
        for store in stores:
            ts = [getattr(store, f) for f in RECORD_FIELDS]
            assert all(t.dtype == torch.int64 and t.is_contiguous() for t in ts)
            keep += ts
            rows.append([t.data_ptr() for t in ts] + [store.n_resident.numel()])
        self.table.write(rows, keep)
        self.key = self.key_of(stores)
        return True

    @staticmethod
    def key_of(stores: list) -> list:
        return [getattr(s, f).data_ptr() for s in stores for f in RECORD_FIELDS]

    def __call__(self) -> None:
        if self.table.n:
            _record_step_kernel[(self.table.n,)](self.ptrs, BLOCK=256)


# The fields of a store's row in `kv.packed.BatchLayout`'s address table: its lengths (`_lens`: dense_len,
# dense_len_next), its heads' scan lengths (L * H_kv int32), its dense page table (L * H_kv rows of pages int32)
# and the page count.
LAYOUT_FIELDS = ("_lens", "audio_len", "dense_table")


@triton.jit
def _gather_layout_kernel(tbl, dlen_ptr, alen_ptr, table_ptr, C, H, P, BLOCK_P: tl.constexpr):
    """Row b's store (program_id(0)), its (layer, KV head) row r (program_id(1)): its scan length and dense page
    table into the batch's (L, C, H) / (L, C, H, P) buffers, and (r = 0) its dense length; an empty row gets
    dense length -1 (no key is written or read) and scan length 0."""
    b = tl.program_id(0)
    r = tl.program_id(1)
    o = ((r // H) * C + b).to(tl.int64) * H + r % H
    lens = tl.load(tbl + b * 4)
    if lens != 0:
        tl.store(alen_ptr + o, tl.load(table_field(tbl, b, 1, tl.int32, 4) + r))
        n_pages = tl.load(tbl + b * 4 + 3)
        src = table_field(tbl, b, 2, tl.int32, 4) + r.to(tl.int64) * n_pages
        for p0 in range(0, P, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            tl.store(table_ptr + o * P + p, tl.load(src + p, mask=p < n_pages, other=0), mask=p < P)
        if r == 0:
            tl.store(dlen_ptr + b, tl.load(table_field(tbl, b, 0, tl.int64, 4)))
    else:
        tl.store(alen_ptr + o, 0)
        if r == 0:
            tl.store(dlen_ptr + b, -1)


@triton.jit
def _advance_kernel(tbl):
    """Row program_id(0)'s store: its dense_len and dense_len_next one further (an empty row: nothing)."""
    lens = tl.load(tbl + tl.program_id(0) * 4)
    if lens != 0:
        p = lens.to(tl.pointer_type(tl.int64))
        tl.store(p, tl.load(p) + 1)
        tl.store(p + 1, tl.load(p + 1) + 1)


def gather_layout(ptrs: torch.Tensor, dense_len: torch.Tensor, audio_len: torch.Tensor, table: torch.Tensor) -> None:
    """`kv.packed.BatchLayout.gather` in one launch: ptrs (C, 4) rows of LAYOUT_FIELDS addresses and page count;
    dense_len (C,) long, audio_len (L, C, H) int32, table (L, C, H, P) int32."""
    L, C, H, P = table.shape
    _gather_layout_kernel[(C, L * H)](ptrs, dense_len, audio_len, table, C, H, P,
                                      BLOCK_P=max(16, min(256, triton.next_power_of_2(P))))


def advance_layout(ptrs: torch.Tensor) -> None:
    """Every row's store one token further (`kv.packed.BatchLayout.advance`) in one launch."""
    _advance_kernel[(ptrs.shape[0],)](ptrs)


@triton.jit
def _read_host_kernel(src_ptr, dst_ptr):
    tl.store(dst_ptr, tl.load(src_ptr))


def read_host(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[0] = src[0] with the GPU reading `src` (pinned host memory) directly."""
    _read_host_kernel[(1,)](src, dst)
