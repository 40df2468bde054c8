"""Triton kernels of the packed store's moves: one launch applies a flush (`PackedAudioKVStore.flush`'s PyTorch
code, the specification, is some 35 small kernels), and the GPU reads the recalled rows from the pinned host
mirror itself (zero-copy over PCIe: no host thread, no staging buffer), so a CUDA graph can hold the whole move.

`flush_rows`: two launches. The first has one program per head (row) that can move, on device memory only.
Recalls first: the row's recalled positions (queued, not resident), ascending, go to its free slots (position -1),
ascending; the (position, slot) pairs are listed in the row's scratch; what finds no free slot is counted in
`overflow`. Then releases free the slots of the queued positions; the row's resident count and scan length (one
past its highest occupied slot) are rebuilt and its queues cleared. The second copies the listed K/V rows from the
host mirror, one program per (row, tile of COPY pairs): many reads in flight over PCIe, where one program per row
would wait on each of its tiles in turn (a slot a release freed in the same flush may receive its rows: it holds
no position, so nothing attends to it).
`queue_segments`: recalls and releases chosen per segment (WnW's chunk swap), both queued in one launch.
`record_step`: a decode step's accounting (resident tokens, rows recalled so far) in one launch.
`read_host`: one element of pinned host memory, the store's probe that the GPU can read it.
Import this module only where `triton` is installed; on a CPU set TRITON_INTERPRET=1 before importing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SCAN, COPY = 1024, 64  # positions or slots per iteration: mask scans; slot scans that copy (COPY x D) K/V tiles


@triton.jit
def _flush_rows_kernel(rows_ptr, base_ptr, cap_ptr, rec_ptr, rel_ptr, slot_of_ptr, pos_ptr,
                       scratch_ptr, n_res_ptr, alen_ptr, overflow_ptr, recalled_ptr, N,
                       SCAN: tl.constexpr, COPY: tl.constexpr):
    i = tl.program_id(0)
    r = tl.load(rows_ptr + i).to(tl.int64)
    base = tl.load(base_ptr + r).to(tl.int64)
    cap = tl.load(cap_ptr + r).to(tl.int64)
    lane = tl.arange(0, SCAN)
    copy_lane = tl.arange(0, COPY)
    row_n = r * N
    W = 2 * N + 1  # scratch row: positions [0, N), their slots [N, 2N), the pair count at 2N
    srow = i.to(tl.int64) * W
    # 1a. the recalled positions (queued, not resident), ascending, listed in this program's scratch row
    n_rec = 0
    for p0 in range(0, N, SCAN):
        p = p0 + lane
        m = p < N
        want = m & (tl.load(rec_ptr + row_n + p, mask=m, other=0) != 0) \
            & (tl.load(slot_of_ptr + row_n + p, mask=m, other=0) < 0)
        k = n_rec + tl.cumsum(want.to(tl.int32), 0) - 1
        tl.store(scratch_ptr + srow + k, p, mask=want)
        n_rec += tl.sum(want.to(tl.int32), 0)
    tl.debug_barrier()
    # 1b. the k-th free slot takes the k-th recalled position (its K/V: _copy_pairs_kernel)
    n_free = 0
    for s0 in range(0, cap, SCAN):
        s = s0 + lane
        m = s < cap
        free = m & (tl.load(pos_ptr + base + s, mask=m, other=0) < 0)
        k = n_free + tl.cumsum(free.to(tl.int32), 0) - 1
        fill = free & (k < n_rec)
        p = tl.load(scratch_ptr + srow + k, mask=fill, other=0)
        tl.store(scratch_ptr + srow + N + k, (base + s).to(tl.int32), mask=fill)
        tl.store(pos_ptr + base + s, p, mask=fill)
        tl.store(slot_of_ptr + row_n + p, s.to(tl.int32), mask=fill)
        n_free += tl.sum(free.to(tl.int32), 0)
    tl.store(scratch_ptr + srow + 2 * N, tl.minimum(n_rec, n_free).to(tl.int32))
    tl.atomic_add(overflow_ptr, tl.maximum(n_rec - n_free, 0).to(tl.int64))
    tl.atomic_add(recalled_ptr, tl.minimum(n_rec, n_free).to(tl.int64))
    tl.debug_barrier()
    # 2. releases, and the row's resident count and scan length
    n_res = 0
    high = 0
    for s0 in range(0, cap, SCAN):
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
    tl.store(n_res_ptr + r, n_res.to(tl.int64))
    tl.store(alen_ptr + r, high.to(tl.int32))
    for p0 in range(0, N, SCAN):
        p = p0 + lane
        m = p < N
        tl.store(rec_ptr + row_n + p, tl.zeros([SCAN], tl.int8), mask=m)
        tl.store(rel_ptr + row_n + p, tl.zeros([SCAN], tl.int8), mask=m)


def flush_rows(rows: torch.Tensor, base: torch.Tensor, caps: torch.Tensor, queued_recall: torch.Tensor,
               queued_release: torch.Tensor, slot_of: torch.Tensor, audio_pos: torch.Tensor, host_k: torch.Tensor,
               host_v: torch.Tensor, audio_k: torch.Tensor, audio_v: torch.Tensor, scratch: torch.Tensor,
               n_resident: torch.Tensor, audio_len: torch.Tensor, overflow: torch.Tensor,
               recalled: torch.Tensor) -> None:
    """Apply the queued moves of `rows` (see the module docstring). queued_* (R, N) bool, slot_of (R, N) int32,
    audio_pos (C,) int32, host_k/v (R * N, D) pinned host memory (in Triton's interpreter: CPU tensors),
    audio_k/v (C, D), scratch (len(rows), 2 N + 1) int32, n_resident (R,) int64, audio_len (R,) int32, overflow and
    recalled int64 counters; base (R,) and caps (R,) each row's first slot and slot count."""
    N, D = queued_recall.shape[1], audio_k.shape[1]
    for t in (queued_recall, queued_release, slot_of, audio_pos, host_k, host_v, audio_k, audio_v, scratch):
        assert t.is_contiguous()
    assert scratch.shape == (len(rows), 2 * N + 1) and scratch.dtype == torch.int32
    _flush_rows_kernel[(len(rows),)](rows, base, caps, queued_recall.view(torch.int8), queued_release.view(torch.int8),
                                     slot_of, audio_pos, scratch, n_resident, audio_len, overflow, recalled, N,
                                     SCAN=SCAN, COPY=COPY)
    _copy_pairs_kernel[(len(rows), triton.cdiv(N, COPY))](rows, scratch, host_k, host_v, audio_k, audio_v, N,
                                                         D=D, COPY=COPY)


@triton.jit
def _copy_pairs_kernel(rows_ptr, scratch_ptr, hk_ptr, hv_ptr, ak_ptr, av_ptr, N, D: tl.constexpr, COPY: tl.constexpr):
    i = tl.program_id(0)
    j = tl.program_id(1)
    srow = i.to(tl.int64) * (2 * N + 1)
    n = tl.load(scratch_ptr + srow + 2 * N)
    k = j * COPY + tl.arange(0, COPY)
    m = k < n
    row_n = tl.load(rows_ptr + i).to(tl.int64) * N
    p = tl.load(scratch_ptr + srow + k, mask=m, other=0).to(tl.int64)
    slot = tl.load(scratch_ptr + srow + N + k, mask=m, other=0).to(tl.int64)
    cols = tl.arange(0, D)
    src = (row_n + p)[:, None] * D + cols[None, :]
    dst = slot[:, None] * D + cols[None, :]
    m2 = m[:, None]
    tl.store(ak_ptr + dst, tl.load(hk_ptr + src, mask=m2), mask=m2)
    tl.store(av_ptr + dst, tl.load(hv_ptr + src, mask=m2), mask=m2)


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
def _queue_segments_kernel(r_ptr, p_ptr, seg_ptr, rec_mask_ptr, rel_mask_ptr, slot_of_ptr, on_host_ptr, qrec_ptr,
                           qrel_ptr, n, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    flat = tl.load(r_ptr + i, mask=m, other=0).to(tl.int64) * N + tl.load(p_ptr + i, mask=m, other=0)
    host = m & (tl.load(on_host_ptr + flat, mask=m, other=0) != 0)
    sg = tl.load(seg_ptr + i, mask=host, other=0)
    resident = tl.load(slot_of_ptr + flat, mask=host, other=0) >= 0
    rec = host & (tl.load(rec_mask_ptr + sg, mask=host, other=0) != 0) & ~resident
    rel = host & (tl.load(rel_mask_ptr + sg, mask=host, other=0) != 0) & resident
    tl.store(qrec_ptr + flat, tl.full([BLOCK], 1, tl.int8), mask=rec)
    tl.store(qrel_ptr + flat, tl.full([BLOCK], 1, tl.int8), mask=rel)


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
def _record_step_kernel(n_res_ptr, R, recalled_ptr, n_rec_ptr, rec_gpu_ptr, rec_rows_ptr, BLOCK: tl.constexpr):
    total = tl.zeros([BLOCK], tl.int64)
    for r0 in range(0, R, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        total += tl.load(n_res_ptr + r, mask=r < R, other=0)
    at = tl.load(n_rec_ptr)
    tl.store(rec_gpu_ptr + at, tl.sum(total, 0))
    tl.store(rec_rows_ptr + at, tl.load(recalled_ptr))
    tl.store(n_rec_ptr, at + 1)


def record_step(n_resident: torch.Tensor, recalled: torch.Tensor, n_rec: torch.Tensor, rec_n_gpu: torch.Tensor,
                rec_rows: torch.Tensor) -> None:
    """`PackedAudioKVStore.record_step` in one launch: at step n_rec, the resident audio tokens (the sum of
    n_resident (R,) int64) and the rows recalled so far (`recalled`, () int64); then n_rec += 1."""
    assert n_resident.is_contiguous() and n_resident.dtype == torch.int64
    _record_step_kernel[(1,)](n_resident, n_resident.numel(), recalled, n_rec, rec_n_gpu, rec_rows, BLOCK=256)


@triton.jit
def _read_host_kernel(src_ptr, dst_ptr):
    tl.store(dst_ptr, tl.load(src_ptr))


def read_host(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[0] = src[0] with the GPU reading `src` (pinned host memory) directly."""
    _read_host_kernel[(1,)](src, dst)
