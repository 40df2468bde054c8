"""Triton decode attention over the dense part plus the ragged, packed audio part of one layer.

Layout (one layer), all on the device, every length a device tensor so the call can be captured in a
CUDA graph (no host synchronisation, fixed grid):
- dense_k, dense_v: (H_kv, C_dense, D); the first `dense_len[0]` rows are valid (same for every head).
- audio_k, audio_v: (C_audio, D) — every KV head's resident audio keys and values packed into one flat
  buffer; head h owns rows [audio_off[h], audio_off[h] + audio_len[h]) (int32 tensors of shape (H_kv,)).
- audio_pos: (C_audio,) the audio position (index in [0, n_audio)) of each packed row, -1 for a free slot
  (skipped: the packed store keeps recall room inside each head's scanned rows).

Semantics are those of `AudioKVStore.attend` (the CPU reference): for each query head, softmax over the
union of its KV head's dense keys and resident audio keys (the reference merges the two parts by
log-sum-exp, which is the same thing), and, for observer query heads, the softmax weights at audio
positions scattered into a dense (n_observe, n_audio) tensor, zero where a position is not resident.

Three kernels (flash-decoding): a split-K partial pass over (KV head, key chunk) that handles all the
query heads of a group with one tensor-core product, a combine pass over the chunks, and — only when
observer heads are asked for — a pass that recomputes their audio scores and writes exp(s - lse).
Triton is optional: import this module only where `triton` is installed (the `gpu` extra).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from wnw_exp.kv.base import upload

BLOCK_N = 64


def dot_precision(dtype: torch.dtype, head_dim: int) -> str:
    """How the tiles multiply: "ieee" (fp32 stays fp32; tl.dot's default TF32 put the packed store 5e-3 off the
    reference on an H200), "tf32"/bf16 for half-precision inputs (tl.dot ignores the setting), or "fma" below a
    head_dim of 16: Hopper compiles no tl.dot with K < 16 in any precision (the H200 refused tiny Qwen's head_dim
    8 with TF32 too), so tiny test models multiply and sum in fp32 instead."""
    if head_dim < 16:
        return "fma"
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _online_softmax_tile(q, k, v, ok, m, lsum, acc, scale, PRECISION: tl.constexpr):
    """One tile of keys through split-K decoding's online softmax (both partial kernels): scores of the query
    group against the tile's keys (`ok` masks the keys that exist), the running max `m`, sum `lsum` and weighted
    values `acc` rescaled to the new max."""
    if PRECISION == "fma":  # K < 16: no tl.dot compiles on Hopper (tiny test models only)
        s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    lsum = lsum * alpha + tl.sum(p, axis=1)
    if PRECISION == "fma":
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
    return m_new, lsum, acc


@triton.jit
def _store_partial(po_ptr, plse_ptr, qh, sp, N_SPLITS, m, lsum, acc, valid, cols, D: tl.constexpr):
    """A split's normalised output and log-sum-exp for the query heads `qh` (rows where `valid`)."""
    out = acc / tl.maximum(lsum, 1e-30)[:, None]
    lse = tl.where(lsum > 0, m + tl.log(tl.maximum(lsum, 1e-30)), float("-inf"))
    tl.store(po_ptr + (qh[:, None] * N_SPLITS + sp) * D + cols[None, :], out, mask=valid[:, None])
    tl.store(plse_ptr + qh * N_SPLITS + sp, lse, mask=valid)


@triton.jit
def _partial_kernel(q_ptr, dk_ptr, dv_ptr, dlen_ptr, ak_ptr, av_ptr, aoff_ptr, alen_ptr, apos_ptr,
                    po_ptr, plse_ptr, scale,
                    s_dk_h, s_dk_n, s_ak_n, N_SPLITS,
                    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                    BLOCK: tl.constexpr, HAS_POS: tl.constexpr, PRECISION: tl.constexpr):
    h = tl.program_id(0)
    sp = tl.program_id(1)
    dlen = tl.load(dlen_ptr)
    aoff = tl.load(aoff_ptr + h)
    alen = tl.load(alen_ptr + h)
    total = dlen + alen
    # each head spreads its own keys over all N_SPLITS programs: a head holding a fifth of the audio is a fifth as
    # deep as the longest one (a split size fixed by the longest head left short heads as deep as long ones)
    tiles = tl.cdiv(tl.cdiv(total, BLOCK), N_SPLITS)
    start = sp * (tiles * BLOCK)
    rows = tl.arange(0, G_PAD)
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + (h * G + rows)[:, None] * D + cols[None, :], mask=(rows < G)[:, None], other=0.0)
    q = q.to(dk_ptr.dtype.element_ty)
    m = tl.full((G_PAD,), -1.0e30, tl.float32)
    lsum = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D), tl.float32)
    n_tiles = tl.minimum(tl.cdiv(tl.maximum(total - start, 0), BLOCK), tiles)
    for t in range(0, n_tiles):
        idx = start + t * BLOCK + tl.arange(0, BLOCK)
        in_d = idx < dlen
        in_a = (idx >= dlen) & (idx < total)
        arow = (aoff + idx - dlen).to(tl.int64)
        if HAS_POS:  # free slots (position -1) hold no key
            in_a = in_a & (tl.load(apos_ptr + arow, mask=in_a, other=-1) >= 0)
        d_off = h.to(tl.int64) * s_dk_h + idx.to(tl.int64)[:, None] * s_dk_n + cols[None, :]
        a_off = arow[:, None] * s_ak_n + cols[None, :]
        k = tl.load(dk_ptr + d_off, mask=in_d[:, None], other=0.0) + tl.load(ak_ptr + a_off, mask=in_a[:, None], other=0.0)
        v = tl.load(dv_ptr + d_off, mask=in_d[:, None], other=0.0) + tl.load(av_ptr + a_off, mask=in_a[:, None], other=0.0)
        m, lsum, acc = _online_softmax_tile(q, k, v, in_d | in_a, m, lsum, acc, scale, PRECISION)
    _store_partial(po_ptr, plse_ptr, h * G + rows, sp, N_SPLITS, m, lsum, acc, rows < G, cols, D)


@triton.jit
def _combine_kernel(po_ptr, plse_ptr, out_ptr, lse_ptr, N_SPLITS,
                    D: tl.constexpr, NS_PAD: tl.constexpr):
    qh = tl.program_id(0)
    sp = tl.arange(0, NS_PAD)
    cols = tl.arange(0, D)
    lse = tl.load(plse_ptr + qh * N_SPLITS + sp, mask=sp < N_SPLITS, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    w = tl.where(lse > float("-inf"), tl.exp(lse - mx), 0.0)
    o = tl.load(po_ptr + (qh * N_SPLITS + sp)[:, None] * D + cols[None, :], mask=(sp < N_SPLITS)[:, None], other=0.0)
    wsum = tl.sum(w, axis=0)
    out = tl.sum(o * w[:, None], axis=0) / tl.where(wsum > 0, wsum, 1.0)  # (no key at all, a padding row: 0)
    tl.store(out_ptr + qh * D + cols, out.to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + qh, mx + tl.log(wsum))


@triton.jit
def _probs_kernel(q_ptr, ak_ptr, apos_ptr, aoff_ptr, alen_ptr, lse_ptr, obs_ptr, probs_ptr, scale,
                  s_ak_n, n_audio,
                  G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    blk = tl.program_id(1)
    qh = tl.load(obs_ptr + i)
    h = qh // G
    aoff = tl.load(aoff_ptr + h)
    alen = tl.load(alen_ptr + h)
    idx = blk * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + qh * D + cols).to(tl.float32)
    arow = (aoff + idx).to(tl.int64)
    pos = tl.load(apos_ptr + arow, mask=idx < alen, other=-1)
    ok = pos >= 0
    k = tl.load(ak_ptr + arow[:, None] * s_ak_n + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    s = tl.sum(k * q[None, :], axis=1) * scale
    lse = tl.load(lse_ptr + qh)
    tl.store(probs_ptr + i.to(tl.int64) * n_audio + pos, tl.exp(s - lse), mask=ok)


@triton.jit
def _observe_sum_kernel(q_ptr, ak_ptr, off_ptr, lse_ptr, slot_tbl, acc_tbl, n_tbl, b_tbl, heads_ptr, nobs_ptr,
                        scale, s_ak_n, H, H_q, NOBS_MAX, G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    """For observer entry o (a stream b = b_tbl[o] whose method sums its observer heads' weights): acc_o[p] +=
    the sum over its heads of their softmax weight at audio position p. One program per (block of positions,
    entry); each head's key found through the stream's slot_of (position -> slot within its KV head's row), so
    every position is written by one program (no atomics: the same sums at every run). The entries' slot_of and
    accumulator live in separate tensors: their addresses come from tables (`ObserverSum`)."""
    o = tl.program_id(1)
    N = tl.load(n_tbl + o)
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_n = p < N  # blocks past this stream's audio load and store nothing
    b = tl.load(b_tbl + o).to(tl.int64)
    slot_of = tl.load(slot_tbl + o).to(tl.pointer_type(tl.int32))
    acc_ptr = tl.load(acc_tbl + o).to(tl.pointer_type(tl.float32))
    cols = tl.arange(0, D)
    local = tl.zeros([BLOCK], tl.float32)
    for i in range(0, tl.load(nobs_ptr + o)):  # in the order of the observer heads, as probs.sum(0) over their rows
        qh = tl.load(heads_ptr + o * NOBS_MAX + i)
        h = qh // G
        slot = tl.load(slot_of + h.to(tl.int64) * N + p, mask=in_n, other=-1)
        ok = slot >= 0
        arow = (tl.load(off_ptr + b * H + h) + slot).to(tl.int64)
        k = tl.load(ak_ptr + arow[:, None] * s_ak_n + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        q = tl.load(q_ptr + (b * H_q + qh) * D + cols).to(tl.float32)
        sc = tl.sum(k * q[None, :], axis=1) * scale
        local += tl.where(ok, tl.exp(sc - tl.load(lse_ptr + b * H_q + qh)), 0.0)
    acc = tl.load(acc_ptr + p, mask=in_n, other=0.0)
    tl.store(acc_ptr + p, acc + local, mask=in_n)


class ObserverSum:
    """One layer's observer weights summed into each stream's accumulator, every stream in one launch
    (`_observe_sum_kernel`): what `observed_probs` + `probs.sum(0)` + an add give per stream, without the
    (n_obs, n_audio) buffer. `entries`: (stream index b, accumulator (n_audio,) float32, the layer's slot_of rows
    (H_kv, n_audio) int32, observer query heads) per observing stream, tensors that live as long as this object
    is used (their addresses are in its tables: made outside any graph capture). With `capacity` (entries) the
    tables and the grid are made for that many entries of up to as many positions and heads as `entries` have, and
    `bind` rewrites them in place for other entries (a graph captured over the launch follows them)."""

    BLOCK = 128

    def __init__(self, entries: list[tuple[int, torch.Tensor, torch.Tensor, list[int]]], device: torch.device,
                 capacity: int | None = None):
        E = len(entries) if capacity is None else capacity
        self.capacity = capacity
        self.nobs_max = max(len(h) for *_, h in entries)
        self.n_max = max(a.shape[0] for _, a, _, _ in entries)
        self.H = entries[0][2].shape[0]
        # each entry's slot_of and accumulator addresses, positions, stream and observer count (one upload)
        self._cols = torch.zeros(5, E, dtype=torch.int64, device=device)
        self.slot_tbl, self.acc_tbl, self.n_tbl, self.b_tbl, self.nobs = self._cols
        self.heads = torch.zeros(E, self.nobs_max, dtype=torch.int32, device=device)
        self.bind(entries)

    def bind(self, entries: list) -> bool:
        """Rewrite the tables for `entries` (outside a graph capture); False (nothing changed) where they do not fit
        (more entries, positions or observer heads than the tables were made for, or another head count)."""
        E = self.heads.shape[0]
        if (len(entries) > E or any(len(h) > self.nobs_max or a.shape[0] > self.n_max or s.shape[0] != self.H
                                    for _, a, s, h in entries)):
            return False
        for _, acc, slot_of, _ in entries:
            assert acc.is_contiguous() and acc.dtype == torch.float32 and slot_of.is_contiguous()
            assert slot_of.dtype == torch.int32 and slot_of.shape[1] == acc.shape[0]
        self.entries = entries  # keeps the tensors alive
        heads = np.zeros((E, self.nobs_max), np.int32)
        cols = np.zeros((5, E), np.int64)  # slot_of, acc, n, b, n_obs (rows past the entries: nothing)
        for o, (b, acc, slot_of, h) in enumerate(entries):
            heads[o, : len(h)] = h
            cols[:, o] = (slot_of.data_ptr(), acc.data_ptr(), acc.shape[0], b, len(h))
        upload(self._cols, torch.from_numpy(cols))
        upload(self.heads, torch.from_numpy(heads))
        return True

    def __call__(self, q: torch.Tensor, audio_k: torch.Tensor, audio_off: torch.Tensor, lse: torch.Tensor,
                 scale: float) -> None:
        """q (B, H_q, D) (or (H_q, D): one stream) after RoPE, audio_k the rows the offsets index, audio_off
        (B, H_kv) (or (H_kv,)) each (stream, KV head)'s first slot row, lse (B, H_q) (or (H_q,)) the attention's
        log-sum-exp."""
        H_q, D = q.shape[-2:]
        assert audio_k.stride(1) == 1 and audio_off.shape[-1] == self.H
        grid = (triton.cdiv(self.n_max, self.BLOCK), self.heads.shape[0])
        _observe_sum_kernel[grid](q.contiguous(), audio_k, audio_off.contiguous(), lse.contiguous(), self.slot_tbl,
                                  self.acc_tbl, self.n_tbl, self.b_tbl, self.heads, self.nobs, scale,
                                  audio_k.stride(0), self.H, H_q, self.nobs_max, G=H_q // self.H, D=D,
                                  BLOCK=self.BLOCK)


# The longest walk of one split-K program, in tiles of BLOCK_N keys. Without it a batch of many (stream, KV head)
# pairs gets one program a pair, and a layer waits for its longest head (WnW's anchors hold the whole audio:
# 48 tiles at 3,000 audio tokens, against ~10 for a tidal head). A single stream of 8 KV heads (33 programs a head)
# reaches it only above 33 * 8 = 264 tiles (~17,000 keys), so its split counts are unchanged below that (tested).
MAX_TILES_PER_PROGRAM = 8


def n_splits_for(max_keys: int, n_kv_heads: int, target_programs: int = 264) -> int:
    """Split-K programs per head for a per-head key bound: enough programs to fill the GPU, none without a tile
    of the longest head, none walking more than MAX_TILES_PER_PROGRAM tiles of it. Each head then spreads its own
    keys over them (the partial kernels)."""
    tiles_total = max(1, triton.cdiv(max_keys, BLOCK_N))
    want = max(1, target_programs // max(n_kv_heads, 1))
    tiles = min(MAX_TILES_PER_PROGRAM, max(1, triton.cdiv(tiles_total, want)))
    return triton.cdiv(tiles_total, tiles)


def decode_attention(q: torch.Tensor, dense_k: torch.Tensor, dense_v: torch.Tensor, dense_len: torch.Tensor,
                     audio_k: torch.Tensor, audio_v: torch.Tensor, audio_off: torch.Tensor,
                     audio_len: torch.Tensor, scale: float, *, max_audio_per_head: int,
                     audio_pos: torch.Tensor | None = None, observe: torch.Tensor | None = None,
                     probs_out: torch.Tensor | None = None,
                     scratch: dict | None = None) -> torch.Tensor:
    """Single-query attention of one layer; returns (H_q, D) in q's dtype.

    `max_audio_per_head` bounds every audio_len (a static number: it fixes the grid). With `audio_pos`, slots
    whose position is -1 are free and skipped. When `observe`
    (int32 query-head indices) is given, `probs_out` (len(observe), n_audio) float32 is zeroed and filled
    with the softmax weights at resident audio positions. `scratch` (a dict) keeps the split buffers between
    calls so that a captured graph reuses the same memory.
    """
    H_q, D = q.shape
    H_kv = dense_k.shape[0]
    G = H_q // H_kv
    max_keys = dense_k.shape[1] + max_audio_per_head
    n_splits = n_splits_for(max_keys, H_kv)
    key = (H_q, D, n_splits)
    s = scratch if scratch is not None else {}
    if s.get("key") != key:
        s.update(key=key,
                 po=torch.empty(H_q, n_splits, D, device=q.device, dtype=torch.float32),
                 plse=torch.empty(H_q, n_splits, device=q.device, dtype=torch.float32),
                 lse=torch.empty(H_q, device=q.device, dtype=torch.float32))
    out = torch.empty(H_q, D, device=q.device, dtype=q.dtype)
    q = q.contiguous()
    assert dense_k.stride(2) == 1 and audio_k.stride(1) == 1 and dense_k.stride() == dense_v.stride()
    assert audio_k.stride() == audio_v.stride()
    _partial_kernel[(H_kv, n_splits)](
        q, dense_k, dense_v, dense_len, audio_k, audio_v, audio_off, audio_len,
        audio_pos if audio_pos is not None else audio_len, s["po"], s["plse"], scale,
        dense_k.stride(0), dense_k.stride(1), audio_k.stride(0), n_splits,
        G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, BLOCK=BLOCK_N, HAS_POS=audio_pos is not None,
        PRECISION=dot_precision(dense_k.dtype, D),
        num_stages=3 if dense_k.element_size() <= 2 else 1)  # fp32 tiles of 3 stages overflow shared memory
    _combine_kernel[(H_q,)](s["po"], s["plse"], out, s["lse"], n_splits, D=D,
                            NS_PAD=max(2, triton.next_power_of_2(n_splits)))
    if observe is not None and len(observe):
        assert probs_out is not None and audio_pos is not None
        probs_out.zero_()
        _probs_kernel[(len(observe), max(1, triton.cdiv(max_audio_per_head, BLOCK_N)))](
            q, audio_k, audio_pos, audio_off, audio_len, s["lse"], observe, probs_out, scale,
            audio_k.stride(0), probs_out.shape[1], G=G, D=D, BLOCK=BLOCK_N)
    return out


# --- a batch of streams: every (stream, KV head) ragged region read from one KV pool (issue 16) ---------------
@triton.jit
def _batched_partial_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, bt_ptr, dlen_ptr, aoff_ptr, alen_ptr, po_ptr, plse_ptr,
                            scale, N_SPLITS, N_PAGES, H: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                            D: tl.constexpr, BLOCK: tl.constexpr, PAGE: tl.constexpr, PRECISION: tl.constexpr):
    bh = tl.program_id(0)  # stream * H + KV head
    sp = tl.program_id(1)
    b = bh // H
    dlen = tl.load(dlen_ptr + b).to(tl.int64)
    bt = bt_ptr + bh.to(tl.int64) * N_PAGES  # this (stream, KV head)'s page table: the pool row of each dense page
    aoff = tl.load(aoff_ptr + bh).to(tl.int64)
    alen = tl.load(alen_ptr + bh).to(tl.int64)
    total = dlen + alen
    tiles = tl.cdiv(tl.cdiv(total, BLOCK), N_SPLITS)  # this (stream, head)'s keys over all splits (`_partial_kernel`)
    start = sp * (tiles * BLOCK)
    rows = tl.arange(0, G_PAD)
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + (bh * G + rows)[:, None] * D + cols[None, :], mask=(rows < G)[:, None], other=0.0)
    q = q.to(k_ptr.dtype.element_ty)
    m = tl.full((G_PAD,), -1.0e30, tl.float32)
    lsum = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D), tl.float32)
    n_tiles = tl.minimum(tl.cdiv(tl.maximum(total - start, 0), BLOCK), tiles)
    for t in range(0, n_tiles):
        idx = start + t * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        in_d = idx < dlen
        in_a = (idx >= dlen) & (idx < total)
        page = tl.load(bt + idx // PAGE, mask=in_d, other=0).to(tl.int64)
        row = tl.where(in_d, page + idx % PAGE, aoff + idx - dlen)  # the key's pool row: dense rows, then audio slots
        in_a = in_a & (tl.load(pos_ptr + row, mask=in_a, other=-1) >= 0)  # free slots hold no key
        ok = in_d | in_a
        k = tl.load(k_ptr + row[:, None] * D + cols[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + row[:, None] * D + cols[None, :], mask=ok[:, None], other=0.0)
        m, lsum, acc = _online_softmax_tile(q, k, v, ok, m, lsum, acc, scale, PRECISION)
    _store_partial(po_ptr, plse_ptr, bh * G + rows, sp, N_SPLITS, m, lsum, acc, rows < G, cols, D)


def decode_attention_batched(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, pool_pos: torch.Tensor,
                             dense_table: torch.Tensor, dense_len: torch.Tensor, audio_off: torch.Tensor,
                             audio_len: torch.Tensor, scale: float, *, max_keys: int, page_rows: int,
                             scratch: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-query attention of one layer for B streams in one launch: q (B, H_q, D); stream b's KV head h reads
    its first dense_len[b] dense tokens through its page table (token i at pool row dense_table[b, h, i // page_rows]
    + i % page_rows; dense_table (B, H, pages) int32, updated in place as pages come) and the audio slots
    [audio_off[b, h], + audio_len[b, h]) of the pool (free slots, position -1 in `pool_pos`, skipped). `max_keys` bounds every dense_len + audio_len (it fixes
    the grid). Returns the output (B, H_q, D) in q's dtype and the log-sum-exp (B, H_q) float32, from which
    `observed_probs` gives observer heads their softmax weights at audio positions."""
    B, H_q, D = q.shape
    H, n_pages = dense_table.shape[1:]
    G = H_q // H
    n_splits = n_splits_for(max_keys, B * H)
    key = (B, H_q, D, n_splits)
    s = scratch if scratch is not None else {}
    if s.get("key") != key:
        s.update(key=key, po=torch.empty(B * H_q, n_splits, D, device=q.device, dtype=torch.float32),
                 plse=torch.empty(B * H_q, n_splits, device=q.device, dtype=torch.float32),
                 lse=torch.empty(B, H_q, device=q.device, dtype=torch.float32))
    out = torch.empty(B, H_q, D, device=q.device, dtype=q.dtype)
    assert pool_k.stride(0) == D and pool_v.stride(0) == D and dense_table.is_contiguous()
    _batched_partial_kernel[(B * H, n_splits)](
        q.contiguous(), pool_k, pool_v, pool_pos, dense_table, dense_len, audio_off, audio_len, s["po"], s["plse"],
        scale, n_splits, n_pages, H=H, G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, BLOCK=BLOCK_N,
        PAGE=int(page_rows), PRECISION=dot_precision(pool_k.dtype, D), num_stages=3 if pool_k.element_size() <= 2 else 1)
    _combine_kernel[(B * H_q,)](s["po"], s["plse"], out, s["lse"], n_splits, D=D,
                                NS_PAD=max(2, triton.next_power_of_2(n_splits)))
    return out, s["lse"]


def observed_probs(q: torch.Tensor, pool_k: torch.Tensor, pool_pos: torch.Tensor, audio_off: torch.Tensor,
                   audio_len: torch.Tensor, lse: torch.Tensor, scale: float, observe: torch.Tensor,
                   probs_out: torch.Tensor, max_audio_per_head: int) -> torch.Tensor:
    """One stream's observer heads after `decode_attention_batched`: q (H_q, D), its audio_off/len (H,), lse (H_q,);
    probs_out (len(observe), n_audio) zeroed and filled with exp(s - lse) at the resident audio positions."""
    H_q, D = q.shape
    probs_out.zero_()
    _probs_kernel[(len(observe), max(1, triton.cdiv(max_audio_per_head, BLOCK_N)))](
        q, pool_k, pool_pos, audio_off, audio_len, lse, observe, probs_out, scale, pool_k.stride(0),
        probs_out.shape[1], G=H_q // audio_off.shape[0], D=D, BLOCK=BLOCK_N)
    return probs_out
