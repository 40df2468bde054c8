"""WnW's per-step chunk-swap decision in one Triton launch (`triage.DeviceChunkSwap.step`'s PyTorch code, the
specification, is some 25 small kernels; with the decision's records and the score reset around it, some 33).

`ChunkSwapTables`: the decisions of several streams (a batch's WnW policies) in one launch, one program per stream,
each stream's tensors found through a table of their addresses (as `kv.triton_moves.FlushTables`); `FusedChunkSwap`,
one stream's decision, is a table of one. The decision is data, the per-segment recall and release masks: the
store queues the moves they ask for (`kv.packed.queue_segments_stores`). Each program

1. sums each chunk's anchor scores in float64, in order (chunk c covers tokens [c n_s, min(c n_s + n_c, N))) and
   divides by the chunk's length: the chunk means;
2. picks the top_k chunks, one argmax at a time, ties to the earlier chunk (the host's stable sort); with
   `locality` > 0 the chunks more than `locality` chunks from the first (the focus) leave the race after it;
3. runs the segment state machine: a segment is wanted when a selected chunk covers it; recall = wanted and not
   recalled; a recalled segment no chosen chunk covers for `delta` consecutive steps is released; with a cap
   (`max_recalled` > 0) the idle segments over it go too, longest unselected first, then the least mean score over
   the segment (a direct float64 sum, as the chunks'), then the earlier segment;
4. writes the masks (selected, recall, release) and, at the stream's decision counter t, its records (the masks and
   the number of recalled segments), increments t and zeroes the scores for the next step.

The chunk sums are direct float64 sums where the PyTorch specification differences float64 prefix sums: the two
can differ in the last bits, which changes a decision only where two chunk means tie to ~1e-13 (exact ties, such
as chunks of zeros, tie in both). Import only where `triton` is installed; on a CPU set TRITON_INTERPRET=1 first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from wnw_exp.kv.triton_moves import AddressRows, table_field
from wnw_exp.methods.wnw.triage import smallest_recall_cap

# The fields of a stream's row in `ChunkSwapTables.ptrs`: its decision's tensors (addresses), then its sizes.
(_A, _RECALLED, _UNSEL, _SEL, _RECALL, _RELEASE, _T, _R_SEL, _R_RECALL, _R_RELEASE, _R_RES, _N, _NS, _NC, _TOPK,
 _DELTA, _CAP, _LOC) = (tl.constexpr(j) for j in range(18))
NF = 18  # (Python's; the kernels read `_NF`: a plain global int is not a constant to the Triton compiler)
_NF = tl.constexpr(NF)


@triton.jit
def _chunk_swap_kernel(tbl, C_PAD: tl.constexpr, S_PAD: tl.constexpr, K_MAX: tl.constexpr, E_MAX: tl.constexpr):
    st = tl.program_id(0)
    if tl.load(tbl + st * _NF + _N) > 0:  # (a row of a table made for more streams than it holds: nothing)
        a_ptr, rec_ptr = table_field(tbl, st, _A, tl.float32, _NF), table_field(tbl, st, _RECALLED, tl.int8, _NF)
        unsel_ptr, sel_ptr = table_field(tbl, st, _UNSEL, tl.int64, _NF), table_field(tbl, st, _SEL, tl.int8, _NF)
        recall_ptr = table_field(tbl, st, _RECALL, tl.int8, _NF)
        release_ptr = table_field(tbl, st, _RELEASE, tl.int8, _NF)
        t_ptr, rec_res_ptr = table_field(tbl, st, _T, tl.int64, _NF), table_field(tbl, st, _R_RES, tl.int64, _NF)
        rec_sel_ptr = table_field(tbl, st, _R_SEL, tl.int8, _NF)
        rec_recall_ptr = table_field(tbl, st, _R_RECALL, tl.int8, _NF)
        rec_release_ptr = table_field(tbl, st, _R_RELEASE, tl.int8, _NF)
        N, n_s = tl.load(tbl + st * _NF + _N), tl.load(tbl + st * _NF + _NS)
        n_c, top_k = tl.load(tbl + st * _NF + _NC), tl.load(tbl + st * _NF + _TOPK)
        delta, loc = tl.load(tbl + st * _NF + _DELTA), tl.load(tbl + st * _NF + _LOC)
        n_seg = (N + n_s - 1) // n_s
        # chunks: start c * n_s while the previous chunk ended before N
        n_ch = tl.maximum((tl.maximum(N - n_c, 0) + n_s - 1) // n_s + 1, 1)
        c = tl.arange(0, C_PAD)
        c_ok = c < n_ch
        start = c.to(tl.int64) * n_s
        end = tl.minimum(start + n_c, N)
        total = tl.zeros([C_PAD], tl.float64)
        for j in range(0, n_c):  # in order, as one running float64 sum per chunk
            p = start + j
            m = c_ok & (p < end)
            total += tl.load(a_ptr + p, mask=m, other=0.0).to(tl.float64)
        length = tl.maximum(end - start, 1).to(tl.float64)
        mean = tl.where(c_ok, total / length, float("-inf"))
        k = tl.minimum(top_k, n_ch)
        selected = tl.zeros([C_PAD], tl.int1)
        s = tl.arange(0, S_PAD)
        s_ok = s < n_seg
        wanted = tl.zeros([S_PAD], tl.int1)
        for it in range(0, K_MAX):
            best = tl.argmax(mean, 0, tie_break_left=True)
            take = it < k
            selected = selected | ((c == best) & take)
            mean = tl.where(c == best, float("-inf"), mean)
            far = (loc > 0) & (it == 0) & (tl.abs(c - best) > loc)  # `locality`: the others near the focus
            mean = tl.where(far, float("-inf"), mean)
            # segments of chunk `best`: from its first token's to its last token's
            b_start = best.to(tl.int64) * n_s
            b_end = tl.minimum(b_start + n_c, N)
            wanted = wanted | (s_ok & take & (s >= b_start // n_s) & (s <= (b_end - 1) // n_s))
        recalled = tl.load(rec_ptr + s, mask=s_ok, other=0) != 0
        unsel = tl.load(unsel_ptr + s, mask=s_ok, other=0)
        recall = wanted & ~recalled
        recalled = recalled | wanted
        unsel = tl.where(wanted, 0, unsel)
        idle = recalled & ~wanted
        unsel = unsel + idle.to(unsel.dtype)
        release = idle & (unsel >= delta)
        recalled = recalled & ~release
        unsel = tl.where(release, 0, unsel)
        cap = tl.load(tbl + st * _NF + _CAP)
        if cap > 0:  # `max_recalled`: idle segments go early, longest unselected first, then the least attended
            seg_start = s.to(tl.int64) * n_s
            seg_end = tl.minimum(seg_start + n_s, N)
            seg_total = tl.zeros([S_PAD], tl.float64)
            for j in range(0, n_s):
                p = seg_start + j
                seg_total += tl.load(a_ptr + p, mask=s_ok & (p < seg_end), other=0.0).to(tl.float64)
            seg_mean = seg_total / tl.maximum(seg_end - seg_start, 1).to(tl.float64)
            excess = tl.sum(recalled.to(tl.int64), 0) - cap
            idle = recalled & ~wanted
            for it in range(0, E_MAX):  # at most one selection's segments over the cap (it held <= cap before)
                most = tl.max(tl.where(idle, unsel, -1), 0)
                pool = idle & (unsel == most)
                pick = tl.argmin(tl.where(pool, seg_mean, float("inf")), 0, tie_break_left=True)
                hit = pool & (s == pick) & (it < excess)
                release = release | hit
                recalled = recalled & ~hit
                idle = idle & ~hit
                unsel = tl.where(hit, 0, unsel)
        tl.store(rec_ptr + s, recalled.to(tl.int8), mask=s_ok)
        tl.store(unsel_ptr + s, unsel, mask=s_ok)
        tl.store(sel_ptr + c, selected.to(tl.int8), mask=c_ok)
        tl.store(recall_ptr + s, recall.to(tl.int8), mask=s_ok)
        tl.store(release_ptr + s, release.to(tl.int8), mask=s_ok)
        # the records, at this stream's decision counter
        t = tl.load(t_ptr)  # the record rows are n_ch / n_seg wide
        tl.store(rec_sel_ptr + t * n_ch + c, selected.to(tl.int8), mask=c_ok)
        tl.store(rec_recall_ptr + t * n_seg + s, recall.to(tl.int8), mask=s_ok)
        tl.store(rec_release_ptr + t * n_seg + s, release.to(tl.int8), mask=s_ok)
        tl.store(rec_res_ptr + t, tl.sum(recalled.to(tl.int64), 0))
        tl.store(t_ptr, t + 1)
        for p0 in range(0, N, 1024):  # the scores start again from zero for the next step
            p = p0 + tl.arange(0, 1024)
            tl.store(a_ptr + p, tl.zeros([1024], tl.float32), mask=p < N)


class ChunkSwapTables:
    """The decisions of several streams' chunk swaps in one launch (`decide`); see the module docstring. `parts`:
    (its `FusedChunkSwap`, its scores (n_audio,) float32) per stream. The tensors' addresses are in a table
    (`ptrs`, one row of NF fields per stream): made outside any graph capture, and rebuilt when any of them
    changes (`key`: compare `ChunkSwapTables.key_of(parts)`), or, made with a `capacity` (streams), rewritten in
    place by `bind` for another set of streams of no more chunks, segments and top_k (a fixed grid: a graph captured
    over the launch follows them); the tensors are kept alive here."""

    def __init__(self, parts: list, device: torch.device, capacity: int | None = None):
        self.capacity = capacity
        self.table = AddressRows(len(parts), NF, device, capacity)
        self.ptrs = self.table.ptrs
        self.pads = self.pads_of(parts)
        self.bind(parts)

    n = property(lambda self: self.table.n)  # the launch's programs (streams)

    @staticmethod
    def pads_of(parts: list) -> dict:
        """The kernel's compile-time bounds for `parts`: chunks, segments (powers of two), top_k and, with a cap, the
        early releases one decision can make (one selection's segments, `triage.smallest_recall_cap`)."""
        return dict(C_PAD=max(16, triton.next_power_of_2(max((f.swap.n_chunks for f, _ in parts), default=1))),
                    S_PAD=max(16, triton.next_power_of_2(max((f.swap.n_seg for f, _ in parts), default=1))),
                    K_MAX=max(1, max((f.top_k for f, _ in parts), default=1)),
                    E_MAX=max(1, max((smallest_recall_cap(f.top_k, f.n_c, f.n_s) if f.max_recalled else 1
                                      for f, _ in parts), default=1)))

    def bind(self, parts: list) -> bool:
        """Rewrite the table for `parts` (outside a graph capture); False (nothing changed) where they do not fit."""
        pads = self.pads_of(parts)
        if len(parts) > self.table.capacity or any(pads[k] > self.pads[k] for k in pads):
            return False
        rows, keep = [], []
        for fused, scores in parts:
            assert scores.is_contiguous() and scores.dtype == torch.float32
            sw, r = fused.swap, fused.records
            assert sw.unselected.dtype == torch.int64 and r["resident"].dtype == torch.int64
            ts = [scores, sw.recalled, sw.unselected, fused.selected, fused.recall, fused.release, fused.t,
                  r["selected"], r["recall"], r["release"], r["resident"]]
            keep += ts
            rows.append([x.data_ptr() for x in ts] + [fused.n_audio, fused.n_s, fused.n_c, fused.top_k, fused.delta,
                                                      fused.max_recalled, fused.locality])
        self.table.write(rows, keep)
        self.key = self.key_of(parts)
        return True

    @staticmethod
    def key_of(parts: list) -> list:
        """What the tables were built from: a part that changes needs new tables."""
        return [k for fused, scores in parts for k in (id(fused), scores.data_ptr())]

    def decide(self) -> None:
        """Every stream's decision, records, counter and score reset (`_chunk_swap_kernel`, one program each)."""
        if self.table.n:
            _chunk_swap_kernel[(self.table.n,)](self.ptrs, **self.pads)


class FusedChunkSwap:
    """`DeviceChunkSwap.step` for one stream in one launch, with the policy's decision records and counter: made
    once per sample, its output masks with it, so nothing is allocated per step (graph-safe)."""

    def __init__(self, swap, records: dict, t: torch.Tensor, n_s: int, n_c: int, top_k: int, delta: int):
        dev = swap.recalled.device
        self.swap, self.records, self.t = swap, records, t
        self.n_s, self.n_c, self.top_k, self.delta = n_s, n_c, top_k, delta
        self.max_recalled, self.locality = swap.max_recalled, swap.locality
        self.n_audio = swap._c.shape[0] - 1
        # the kernel derives the segment and chunk counts (its record widths) from n_audio, n_s and n_c
        assert swap.n_seg == triton.cdiv(self.n_audio, n_s)
        assert swap.n_chunks == triton.cdiv(max(self.n_audio - n_c, 0), n_s) + 1
        assert records["recall"].shape[1] == swap.n_seg and records["selected"].shape[1] == swap.n_chunks
        for x in (swap.recalled, swap.unselected, *records.values()):
            assert x.is_contiguous()
        self.selected = torch.zeros(swap.n_chunks, dtype=torch.bool, device=dev)
        self.recall = torch.zeros(swap.n_seg, dtype=torch.bool, device=dev)
        self.release = torch.zeros(swap.n_seg, dtype=torch.bool, device=dev)
        self._tables: ChunkSwapTables | None = None  # this stream alone (a table of one), for its scores

    def __call__(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decide from `scores` (n_audio,) float32, which it zeroes; returns the (selected, recall, release) masks
        (the same tensors every step)."""
        parts = [(self, scores)]
        if self._tables is None or self._tables.key != ChunkSwapTables.key_of(parts):
            self._tables = ChunkSwapTables(parts, scores.device)
        self._tables.decide()
        return self.selected, self.recall, self.release
