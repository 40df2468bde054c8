"""The GPU KV-tier store (`kv.base.KVStore`): packed device buffers, device-side bookkeeping, and queued moves
applied on the device, so that a decode step, a method's decisions and the moves they make can all be captured
in one CUDA graph (no host read anywhere on that path).

Layout (row r = layer * H_kv + head):
- dense part: one (L, H_kv, C_dense, D) buffer; one device counter `dense_len` shared by all layers (every layer
  sees the same non-audio tokens); `dense_len_next` = dense_len + 1, what attention reads once the step's token
  is appended. In a `KVPool` (a batch's streams) the dense part is paged instead: a page is one pool block per
  row, `dense_table` (L*H, pages) holds each page's first pool row, and pages are asked for as the text grows
  (`ensure_dense`); the audio part is one extent of the pool.
- audio part: one flat (C, D) buffer each for K and V; row r owns the slots [base_r, base_r + cap_r).
  `audio_pos[slot]` is the audio position a slot holds, -1 when the slot is free. Attention scans each head's
  first `audio_len[l, h]` slots (the high-water mark of its occupied slots) and skips free ones; slot order
  inside a head is free (attention is order-free).
- bookkeeping: `slot_of` (L*H, n_audio) int32, each resident position's slot within its row (-1: not resident);
  `on_host` (L*H, n_audio) bool, the positions with a host copy (fixed after `set_tiers`); `n_resident` (L*H,).
- host tier: a mirror (n_mirrored, n_audio, D) of the audio K/V written at prefill, pinned on CUDA (ArkVale-style),
  of every row or only of the rows that may offload (`host_mirror`; `host_row` maps a row to its mirror row, -1
  without one); which positions may be recalled is `on_host`, exactly as in the reference.
`compact(headroom)` after prefill shrinks every head's region to its resident count plus `headroom` free slots for
heads that can recall, so the device memory held really drops (the old buffers are freed, not masked) even when
some heads (WnW's anchors) keep all their audio.

Moves: `recall` / `release` mark (row, position) pairs in two device masks (a fixed-shape `select` mask lets a
device-side method queue without a host read). `flush` applies them, on the heads that can move (those with a
host copy): recalls first, each head's recalled positions (ascending) into its free slots (lowest first), then
releases free their slots. With `kernels="triton"` two kernels do it (kv/triton_moves.py), the GPU reading the
recalled K/V from the pinned host mirror itself (zero-copy over PCIe, no host involvement: graph-safe), and
`flush_stores` flushes a batch's stores together in the same two launches; with
`kernels="torch"` fixed-shape PyTorch ops do it (the specification), the host copying the recalled rows (not
graph-safe). A recall that does not fit a head's free slots
raises at once when moves are queued from the host, and is counted in `overflow` (checked by `check()`) when
they are queued inside a captured graph.

Accounting (§3.4) is device-side as well: `end_step` applies the queued moves and records the step's resident
count and recalled rows into device buffers (`record_step`, graph-safe); `steps` reads them back.
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from wnw_exp.kv.base import HostRead, KVStore, StepAccounting, StepRecord, to_device, to_host, upload
from wnw_exp.kv.pool import KVPool, PoolFull


def _triton_usable(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


# (device, dtype) -> (whether the device reads pinned host memory, why not): `PackedAudioKVStore._probe_zero_copy`
_ZERO_COPY: dict = {}


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@dataclass(frozen=True)
class AttentionLayout:
    """What a decode step's attention reads of a packed store (`PackedAudioKVStore.attention_layout`), per (layer,
    KV head). The host arrays are the layout when asked (it changes only in `compact`: ask after it); the tensors
    are the store's own, updated in place by appends, new dense pages and moves (a graph captured over them
    follows them)."""

    audio_off: np.ndarray  # (L, H_kv) int64: first row of each head's audio slots (a pool row in a pool, else a row
    # of the store's audio_k / audio_v)
    caps: np.ndarray  # (L, H_kv) int64: the audio slots each head owns
    max_audio_per_head: int  # caps.max(): the longest audio scan of any head
    dense_rows_max: int  # the dense tokens the store can hold (the prompt's text and dense_capacity more)
    audio_len: torch.Tensor  # (L, H_kv) int32: the slots each head's attention scans (one past its highest occupied)
    dense_len: torch.Tensor  # (1,) long: the dense tokens held before the step's token
    block_table: torch.Tensor | None  # (L, H_kv, pages) int32, in a pool: each dense page's first pool row


class PackedAudioKVStore(StepAccounting, KVStore):
    queues_moves = True

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_audio: int, device: torch.device,
                 dtype: torch.dtype, dense_capacity: int, kernels: str = "auto", pool: KVPool | None = None,
                 expected_new_tokens: int | None = None, host_mirror=True):
        """`kernels`: "triton" (attention: kv/triton_attention.py; flush and zero-copy recall: kv/triton_moves.py;
        on CUDA, or in Triton's interpreter on a CPU), "torch" (`attention_torch` and the PyTorch flush, their
        specification; recalls staged through the host) or "auto" (triton on CUDA when installed, else torch).
        `pool`: a `KVPool` shared by the streams of a batch; `compact` then places every head's audio region in one
        extent of it and the prompt's text in dense pages (`PoolFull` where it lacks the room), the generated
        tokens' dense rows come in pages as they are needed (`ensure_dense`), and `release_memory` gives it all back.
        `expected_new_tokens` (pool only): the dense growth admission counts on (`outstanding_blocks`; None: every
        token of `dense_capacity`). Without a pool the store allocates its own (its dense part for `dense_capacity`
        tokens at once). `host_mirror`: keep a (pinned) host copy of the prompt's audio KV, the CPU tier recalls read:
        True for every row, False for methods that never offload (`Policy.cpu_tier`: no host memory, no copy at
        prefill), or the rows (layer * H_kv + head) that may offload (WnW's tidal heads), the only ones mirrored and
        the only ones `set_tiers` may give a host tier."""
        self.n_layers, self.n_kv_heads, self.head_dim, self.n_audio = n_layers, n_kv_heads, head_dim, n_audio
        self.device, self.dtype, self.dense_capacity = torch.device(device), dtype, dense_capacity
        if kernels == "auto":
            kernels = "triton" if _triton_usable(self.device) else "torch"
        if kernels not in ("triton", "torch"):
            raise ValueError(f"unknown kernels {kernels!r}: triton, torch or auto")
        self.kernels = self.moves = kernels  # `moves`: the flush's implementation (torch after a failed probe)
        # A graph can hold the moves only where the GPU reads the pinned host mirror itself (the Triton flush).
        self.graph_safe = kernels == "triton" and self.device.type == "cuda"
        L, H, D, N, dev = n_layers, n_kv_heads, head_dim, n_audio, self.device
        R = L * H
        self.n_rows = R
        self.pool, self.extent = pool, None
        # Pool only: the dense part in pages of `page` rows, one pool block per (layer, KV head) each;
        # dense_table[row, p] = the pool row of that row's dense token p * page (fixed shape, updated in place).
        self.page = pool.block if pool is not None else 0
        self.expected_new_tokens = dense_capacity if expected_new_tokens is None else min(expected_new_tokens,
                                                                                            dense_capacity)
        self._pages: list[list] = []  # per page index: its L * H_kv blocks (`kv.pool.Extent`)
        self._dense_room = 0  # the dense tokens its pages hold (`ensure_dense`)
        self.dense_table: torch.Tensor | None = None
        self.n_text = 0  # the prompt's non-audio tokens
        self.caps = np.full(R, N, np.int64)  # slots each row owns (host: the layout only changes in compact)
        self._set_layout()
        self.audio_k = torch.empty(R * N, D, device=dev, dtype=dtype)
        self.audio_v = torch.empty_like(self.audio_k)
        if pool is not None and (pool.head_dim, pool.dtype, pool.k.device) != (head_dim, dtype, self.audio_k.device):
            raise ValueError("the KV pool's head_dim, dtype and device must be the store's")
        self.audio_pos = torch.arange(N, device=dev, dtype=torch.int32).repeat(R)
        self.audio_len = torch.full((L, H), N, device=dev, dtype=torch.int32)
        pin = self.device.type == "cuda"
        if isinstance(host_mirror, (bool, np.bool_)):
            mirrored = np.arange(R if host_mirror else 0)
        else:
            mirrored = np.unique(np.asarray(host_mirror, np.int64).ravel())
            if len(mirrored) and (mirrored[0] < 0 or mirrored[-1] >= R):
                raise ValueError(f"host_mirror: rows must be in [0, {R}) (layer * n_kv_heads + head)")
        self._pending_checks: torch.Tensor | None = None  # `defer_checks`
        self.host_row = np.full(R, -1, np.int64)  # each row's mirror row (-1: none)
        self.host_row[mirrored] = np.arange(len(mirrored))
        self._host_row = to_device(self.host_row, dev)
        # mirror row m's KV head (mirror rows follow the row order): `write_prefill` gathers a layer's mirrored heads
        # with a slice of it (no copy to the device a layer)
        self._mirror_head = to_device(mirrored % n_kv_heads, dev)
        # 2 x L x H_kv x N x D values (368 MB of pinned memory a stream for 4 min of audio on Voxtral-Mini-3B), or
        # only the mirrored rows': only for a method with a CPU tier; in a pool, out of its host arena
        # (`KVPool.host_buffer`)
        host = pool.host_buffer if pool is not None else lambda shape, dt: torch.empty(shape, dtype=dt, pin_memory=pin)
        M = len(mirrored)
        self.host_k = host((M, N, D), dtype) if M else None
        self.host_v = host((M, N, D), dtype) if M else None
        self.slot_of = torch.arange(N, device=dev, dtype=torch.int32).repeat(R, 1)
        self.on_host = torch.zeros(R, N, device=dev, dtype=torch.bool)
        self.n_resident = torch.full((R,), N, device=dev, dtype=torch.int64)
        self.queued_recall = torch.zeros(R, N, device=dev, dtype=torch.bool)
        self.queued_release = torch.zeros(R, N, device=dev, dtype=torch.bool)
        self.overflow = torch.zeros((), device=dev, dtype=torch.int64)  # recalls that found no free slot
        self._union: int | None = None
        self._released_bytes = 0  # what its audio held in the pool when `release_memory` gave it back
        self.dense_k: torch.Tensor | None = None
        self.dense_v: torch.Tensor | None = None
        self._lens = to_device([0, 1], dev, torch.long)  # one add advances both (`advance`)
        self.dense_len, self.dense_len_next = self._lens[0:1], self._lens[1:2]
        self._dense_n = 0  # host copy of dense_len for the eager `attend` (not advanced by graph replays)
        self.layer_audio = [N] * L
        # Per-step records on the device: resident audio tokens and recalled rows; `steps` reads them back.
        self._recalled = torch.zeros((), device=dev, dtype=torch.int64)  # rows recalled so far (cumulative)
        self._rec_n_gpu = torch.zeros(dense_capacity + 2, device=dev, dtype=torch.int64)
        self._rec_rows = torch.zeros(dense_capacity + 2, device=dev, dtype=torch.int64)
        self._n_rec = torch.zeros((), device=dev, dtype=torch.long)  # steps recorded
        self._scratch: list[dict] = [{} for _ in range(L)]  # attention split buffers, reused by a graph
        self._observer_sums: dict = {}  # layer -> (its tensors' addresses, the ObserverSum made for them)
        self._record_held: dict = {}  # its `record_step` with Triton kernels: a `RecordTables` of one

    def _set_layout(self) -> None:
        self.base = np.concatenate([[0], np.cumsum(self.caps)])  # first slot of each row; base[-1] = C
        self._offsets = to_device(self.base[:-1], self.device, torch.int32)
        self._caps = to_device(self.caps, self.device, torch.int32)
        self._max_cap = int(self.caps.max()) if len(self.caps) else 0
        self._blocks: dict | None = None  # the rows a flush works on (`_flush_blocks`), made when first needed

    def attention_layout(self) -> AttentionLayout:
        """The attention metadata of every (layer, KV head): where its audio slots start and how many it owns, the
        longest scan, the dense capacity, and the device lengths and (in a pool) the dense page table."""
        L, H = self.n_layers, self.n_kv_heads
        row0 = self.extent.start if self.extent is not None else 0
        table = self.dense_table.view(L, H, -1) if self.dense_table is not None else None
        return AttentionLayout(audio_off=(row0 + self.base[:-1]).reshape(L, H), caps=self.caps.reshape(L, H).copy(),
                               max_audio_per_head=self._max_cap, dense_rows_max=self.dense_rows_max,
                               audio_len=self.audio_len, dense_len=self.dense_len, block_table=table)

    # --- writing ------------------------------------------------------------------------------
    def write_prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor, audio_span: tuple[int, int]) -> None:
        s, e = audio_span
        assert e - s == self.n_audio, "token merging (affpool) is not supported by the packed store"
        H, D, N = self.n_kv_heads, self.head_dim, self.n_audio
        dk = torch.cat([k[:, :s], k[:, e:]], dim=1)
        if self.dense_k is None:
            n = self.n_text = dk.shape[1]
            room = 0 if self.pool is not None else self.dense_capacity  # in a pool the generated rows come in pages
            self.dense_k = torch.empty(self.n_layers, H, n + room, D, device=self.device, dtype=self.dtype)
            self.dense_v = torch.empty_like(self.dense_k)
            self._dense_n = n
            self.dense_len.fill_(n)
            self.dense_len_next.fill_(n + 1)
        self.dense_k[layer, :, : self._dense_n] = dk
        self.dense_v[layer, :, : self._dense_n] = torch.cat([v[:, :s], v[:, e:]], dim=1)
        base = int(self.base[layer * H])  # before compact() every row owns n_audio slots
        self.audio_k[base: base + H * N].view(H, N, D).copy_(k[:, s:e])
        self.audio_v[base: base + H * N].view(H, N, D).copy_(v[:, s:e])
        heads = np.flatnonzero(self.host_row[layer * H:(layer + 1) * H] >= 0)  # the layer's mirrored heads
        if len(heads):  # their mirror rows are consecutive (rows in order)
            m0 = int(self.host_row[layer * H + heads[0]])
            pick = slice(None) if len(heads) == H else self._mirror_head[m0:m0 + len(heads)]
            self.host_k[m0:m0 + len(heads)].copy_(k[pick, s:e], non_blocking=True)
            self.host_v[m0:m0 + len(heads)].copy_(v[pick, s:e], non_blocking=True)

    def set_tiers(self, layer: int, head: int, gpu: torch.Tensor, cpu: torch.Tensor | None = None) -> None:
        """Keep `gpu` positions resident, make `cpu` recallable, drop the rest (as the reference): `set_tiers_block`
        of one row."""
        dev = self.device
        keep = torch.zeros(1, self.n_audio, dtype=torch.bool, device=dev)
        keep[0, torch.as_tensor(gpu, device=dev).long()] = True
        host = None
        if cpu is not None and len(cpu):
            host = torch.zeros_like(keep)
            host[0, torch.as_tensor(cpu, device=dev).long()] = True
        self.set_tiers_block(self.row(layer, head), keep, host)

    def set_tiers_block(self, row0: int, gpu: torch.Tensor, cpu: torch.Tensor | None = None,
                        select: torch.Tensor | None = None) -> None:
        """`set_tiers` of the consecutive rows row0 .. row0 + m - 1 at once (a layer's heads: row0 = layer * H_kv).

        `gpu` (m, n_audio) bool: the positions each row keeps resident; `cpu` (m, n_audio) bool or None: those that
        get a host copy (may overlap `gpu`: a mirror); `select` (m,) bool or None (all): the rows to set, the others
        are left as they are. Each row's kept positions go to its first slots in ascending order, its other slots are
        freed, exactly as one `set_tiers` per row. Fixed-shape device work over the rows' slots and one host read,
        the residency check, made before anything changes (a ValueError then changes nothing; after `defer_checks`,
        read at the next `compact` instead)."""
        dev, m = self.device, gpu.shape[0]
        if cpu is not None and self.host_k is None:
            raise ValueError("set_tiers: this store keeps no host tier (host_mirror=False); a method that offloads to "
                             "the CPU declares cpu_tier = True")
        rows = slice(row0, row0 + m)
        sel = torch.ones(m, dtype=torch.bool, device=dev) if select is None else select.to(dev, torch.bool)
        keep = gpu.to(dev, torch.bool) & sel[:, None]
        host = torch.zeros_like(keep) if cpu is None else cpu.to(dev, torch.bool) & sel[:, None]
        old_slot = self.slot_of[rows]
        resident = old_slot >= 0
        unmirrored = (self._host_row[rows] < 0)[:, None]
        bad = torch.stack([(keep & ~resident).any(), (host & ~resident).any(), (host & unmirrored).any()])
        if self._pending_checks is not None:  # read at the next compact (`defer_checks`)
            self._pending_checks |= bad
        else:
            self._raise_bad(bad)  # one read
        n = keep.sum(dim=1)  # (m,) the new resident counts
        new_slot = torch.where(keep, keep.cumsum(dim=1) - 1, -1).int()
        by_slot = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices  # row i's j-th kept position, j < n_i
        # Every slot of the rows' regions [base[row0], base[row0 + m]): its row i and its index j in that row.
        s0, s1 = int(self.base[row0]), int(self.base[row0 + m])
        offsets, caps = self._offsets[rows].long(), self._caps[rows].long()
        slot = torch.arange(s0, s1, device=dev)
        i = torch.repeat_interleave(torch.arange(m, device=dev), caps, output_size=s1 - s0)
        j = slot - offsets[i]
        pos = by_slot[i, j]  # the position slot j of row i will hold (j < cap_i <= n_audio)
        filled = j < n[i]
        moved = sel[i] & filled
        src = torch.where(moved, offsets[i] + old_slot[i, pos].long(), slot)
        self.audio_k[s0:s1] = self.audio_k[src]  # the right side is gathered first: no overlap hazard
        self.audio_v[s0:s1] = self.audio_v[src]
        self.audio_pos[s0:s1] = torch.where(sel[i], torch.where(filled, pos, -1), self.audio_pos[s0:s1]).int()
        self.slot_of[rows] = torch.where(sel[:, None], new_slot, old_slot)
        self.on_host[rows] = torch.where(sel[:, None], host, self.on_host[rows])
        self.n_resident[rows] = torch.where(sel, n, self.n_resident[rows])
        audio_len = self.audio_len.view(-1)
        audio_len[rows] = torch.where(sel, n.int(), audio_len[rows])
        self._union = None
        self._blocks = None

    def defer_checks(self) -> None:
        """The residency checks of the `set_tiers_block` calls that follow are read once, at the next `compact`
        (a placement of every layer: one host read rather than one a layer, each of which would wait for the
        device); a violation then raises there, after the store has changed (the stream is then abandoned)."""
        self._pending_checks = torch.zeros(3, dtype=torch.bool, device=self.device)

    @staticmethod
    def _raise_bad(bad) -> None:
        bad_keep, bad_host, bad_row = bad.tolist()
        if bad_keep:
            raise ValueError("set_tiers: a position to keep is not GPU-resident")
        if bad_host:
            raise ValueError("set_tiers: a position to offload is not GPU-resident")
        if bad_row:
            raise ValueError("set_tiers: a row to offload has no host mirror (not among the store's host_mirror rows)")

    def compact(self, headroom: int | np.ndarray = 0, reserve_blocks: int = 0) -> None:
        """Shrink each head's region to its resident count, + `headroom` rows where it can recall (frees memory).
        `headroom`: one count for every head, or one per row (L * H_kv,) = layer * H_kv + head (WnW sizes each
        tidal head's room by what its recalls can hold at once). A recall past a head's room raises.
        `reserve_blocks` (pool only): blocks that must stay free besides what the placement takes (admission by
        expected growth: this stream's and the running streams' expected dense pages), else `PoolFull`."""
        headroom = np.asarray(headroom, np.int64)
        if headroom.ndim and headroom.shape != self.caps.shape:
            raise ValueError(f"compact: headroom has shape {headroom.shape}, expected () or {self.caps.shape}")
        # one host read (each would wait for the device): the deferred checks, each row's resident count, which rows
        # hold a host tier (heads that never recall, anchors and fixed ones, need no room) and the union's size
        pending, self._pending_checks = self._pending_checks, None
        reads = [self.n_resident, self.on_host.any(dim=1), (self.slot_of >= 0).logical_or(self.on_host).sum()]
        if pending is not None:
            reads.append(pending)
        n_res, recallable, union, *bad = (x.numpy() for x in to_host(*reads))
        if pending is not None:
            self._raise_bad(bad[0])
        union = int(union)
        new_caps = np.minimum(self.n_audio, n_res + np.where(recallable, headroom, 0))
        if self.pool is not None:
            self._into_pool(new_caps, reserve_blocks)
        elif not np.array_equal(new_caps, self.caps):
            keep = torch.as_tensor(np.concatenate([np.arange(b, b + c) for b, c in zip(self.base[:-1], new_caps)]),
                                   device=self.device)
            self.audio_k = self.audio_k[keep]  # new, exactly sized tensors: the old buffers are freed
            self.audio_v = self.audio_v[keep]
            self.audio_pos = self.audio_pos[keep]
            self.caps = new_caps
            self._set_layout()
        self.audio_len.view(-1).copy_(to_device(n_res, self.device))
        self._union = union  # (compaction moves no position between tiers)
        self._blocks = None
        self._flush_blocks(recallable)
        if self.graph_safe and recallable.any():  # (nothing reads the host mirror otherwise)
            self._probe_zero_copy()

    def rows_needed(self, caps: np.ndarray) -> int:
        """K/V rows of a stream in a pool at placement: the audio regions and the prompt's dense pages."""
        return int(caps.sum()) + self.n_layers * self.n_kv_heads * self._pages_for(self.n_text) * max(self.page, 1)

    def _pages_for(self, n_tokens: int) -> int:
        return -(-int(n_tokens) // self.page) if self.page else 0

    @property
    def dense_rows_max(self) -> int:
        """The dense tokens the store can hold: the prompt's text and `dense_capacity` more."""
        return self.n_text + self.dense_capacity

    def outstanding_blocks(self) -> int:
        """Pool only: the dense pages (blocks) the stream is expected to ask for still (its prompt's and its
        expected answer's, `expected_new_tokens`, less those it holds)."""
        want = self._pages_for(self.n_text + self.expected_new_tokens)
        return self.n_layers * self.n_kv_heads * max(0, want - len(self._pages))

    def growth_blocks(self) -> int:
        """Pool only: the dense pages (blocks) its expected answer adds to its prompt's."""
        return self.n_layers * self.n_kv_heads * max(
            0, self._pages_for(self.n_text + self.expected_new_tokens) - self._pages_for(self.n_text))

    def pool_blocks(self) -> int:
        """Pool only: the blocks the store holds (its extent and its dense pages)."""
        return (self.extent.n_blocks if self.extent is not None else 0) + sum(len(p) for p in self._pages)

    def _into_pool(self, new_caps: np.ndarray, reserve_blocks: int = 0) -> None:
        """Move each row's first `new_caps` slots into one extent of the pool and the prompt's dense rows into
        pages (raise `PoolFull`, changing nothing, where the pool lacks the room, `reserve_blocks` kept free);
        the store's own prefill buffers are freed."""
        assert self.extent is None, "compact() into a pool runs once"
        pool, L, H = self.pool, self.n_layers, self.n_kv_heads
        n_audio_rows = int(new_caps.sum())
        n_pages = self._pages_for(self.n_text)
        need = pool.blocks_for(max(n_audio_rows, 1)) + L * H * n_pages + int(reserve_blocks)
        if not pool.can_alloc(max(n_audio_rows, 1)) or need > pool.free_blocks:
            pool.n_refused += 1
            rb = pool.block * pool.row_bytes
            raise PoolFull(f"the stream needs {self.rows_needed(new_caps) * pool.row_bytes / 1e6:.1f} MB of KV "
                           f"(+ {int(reserve_blocks) * rb / 1e6:.1f} MB kept for expected growth), the pool has "
                           f"{pool.capacity_bytes / 1e6:.1f} MB of which {pool.stats()['used_bytes'] / 1e6:.1f} in use")
        ext = self.extent = pool.alloc(n_audio_rows)
        k, v, pos = pool.views(ext)
        keep = to_device(np.concatenate([np.arange(b, b + c) for b, c in zip(self.base[:-1], new_caps)]), self.device)
        torch.index_select(self.audio_k, 0, keep, out=k)
        torch.index_select(self.audio_v, 0, keep, out=v)
        self.audio_k, self.audio_v = k, v  # the full prefill buffers are freed here
        torch.index_select(self.audio_pos, 0, keep, out=pos)
        self.audio_pos = pos
        self.caps = new_caps
        self._set_layout()
        # the dense part: a page table (L * H, pages the store can reach), its prompt rows copied into their pages
        self.dense_table = torch.zeros(L * H, self._pages_for(self.dense_rows_max), device=self.device,
                                       dtype=torch.int32)
        prompt_k, prompt_v = self.dense_k.reshape(L * H, -1, self.head_dim), self.dense_v.reshape(L * H, -1, self.head_dim)
        self.dense_k = self.dense_v = None
        self.ensure_dense(self.n_text)  # there is room: checked above
        if self.n_text:
            rows = self._dense_rows(torch.arange(self.n_text, device=self.device), slice(None)).reshape(-1)
            pool.k.index_copy_(0, rows, prompt_k.reshape(-1, self.head_dim))
            pool.v.index_copy_(0, rows, prompt_v.reshape(-1, self.head_dim))

    def ensure_dense(self, n_tokens: int) -> bool:
        """Pool only: dense pages for the first `n_tokens` dense tokens of every (layer, KV head), asked of the pool
        a page (one block per row) at a time; False (nothing taken for the page that failed) where the pool has no
        free blocks left. Raises where `n_tokens` is past the store's capacity."""
        if n_tokens <= self._dense_room:  # (every decode step asks: the pages it has hold the token)
            return True
        if n_tokens > self.dense_rows_max:
            raise RuntimeError("dense KV capacity exhausted: raise the engine's max_new_tokens capacity")
        while len(self._pages) < self._pages_for(n_tokens):
            got = self.pool.alloc_blocks(self.n_rows)
            if got is None:
                return False
            p = len(self._pages)
            self._pages.append(got)
            upload(self.dense_table[:, p], torch.tensor([e.start for e in got], dtype=torch.int32))  # (no host wait)
            self._dense_room = min(len(self._pages) * self.page, self.dense_rows_max)
        return True

    @property
    def dense_pages(self) -> int:
        return len(self._pages)

    def _dense_rows(self, idx: torch.Tensor, rows) -> torch.Tensor:
        """Pool rows (n_rows, len(idx)) of dense tokens `idx` (device long) of the store rows `rows` (a slice)."""
        return self.dense_table[rows].index_select(1, idx // self.page).long() + (idx % self.page)

    def release_memory(self) -> None:
        """The stream has left (or was preempted): give its extent and its dense pages back to the pool (the store
        must not be used after)."""
        if self.pool is not None and self.extent is not None:
            self._released_bytes = self.audio_bytes_on_device()
            self.pool.free_many([self.extent] + [e for page in self._pages for e in page])  # in one pass
            self.extent = None
            self._pages = []
            self._dense_room = 0
            self.audio_k = self.audio_v = self.dense_k = self.dense_v = None
        if self.pool is not None and self.host_k is not None:  # the next stream of this shape pins nothing new
            self.pool.give_host(self.host_k)
            self.pool.give_host(self.host_v)
            self.host_k = self.host_v = None

    def _probe_zero_copy(self) -> None:
        """Read the pinned host mirror from the GPU once per device and process, before any graph needs it (a
        property of the device and the host, not of one store: the other stores reuse the answer, no host read);
        where the GPU cannot, fall back to the PyTorch flush (recalls staged through the host) and the engine to
        steps without a graph."""
        from wnw_exp.kv.triton_moves import read_host

        key = (str(self.device), self.dtype)
        ok, why = _ZERO_COPY.get(key, (None, ""))
        if ok is None:
            got = torch.zeros(1, device=self.device, dtype=self.dtype)
            try:
                read_host(self.host_k.view(-1), got)
                ok, why = bool(got.cpu()[0] == self.host_k.view(-1)[0]), "the value read differs"
            except Exception as e:  # noqa: BLE001 - any failure means: do not rely on it
                ok, why = False, f"{type(e).__name__}: {e}"
            _ZERO_COPY[key] = ok, why
        if not ok:
            warnings.warn(f"packed store: the GPU cannot read the pinned host mirror ({why}); recalls are staged "
                          "through the host, and decode steps run without a CUDA graph", stacklevel=2)
            self.graph_safe, self.moves = False, "torch"

    # --- moving between tiers -----------------------------------------------------------------
    def row(self, layer: int, head: int) -> int:
        return layer * self.n_kv_heads + head

    def _pairs(self, rows, positions, select):
        pos = torch.as_tensor(positions, device=self.device).long().reshape(-1)
        r = torch.as_tensor(rows, device=self.device).long().reshape(-1).expand_as(pos)
        sel = None if select is None else torch.as_tensor(select, device=self.device).reshape(-1)
        return r, pos, sel

    def recall(self, rows, positions, select=None) -> int | None:
        """Queue host-tier positions for copying back (resident and already queued ones are skipped). Pairs must
        be distinct. Returns how many were queued, or None inside a graph capture (no host read there)."""
        r, p, sel = self._pairs(rows, positions, select)
        if _capturing() and self.moves == "triton":  # the same marks in one launch (kv/triton_moves.py)
            from wnw_exp.kv.triton_moves import queue_pairs

            queue_pairs(True, r, p, sel, self.slot_of, self.on_host, self.queued_recall)
            return None
        new = ~(self.slot_of[r, p] >= 0) & ~self.queued_recall[r, p]
        if sel is not None:
            new &= sel
        if _capturing():  # no host read: what has no host copy is not queued (it cannot be recalled)
            self.queued_recall.index_put_((r, p), self.queued_recall[r, p] | (new & self.on_host[r, p]))
            return None
        if not bool(self.on_host[r, p][new].all()):
            raise ValueError("recall: positions have no host copy (they were dropped)")
        counts = torch.zeros(self.n_rows, device=self.device, dtype=torch.int64).index_add_(0, r, new.long())
        held = self.n_resident + self.queued_recall.sum(dim=1) + counts
        if bool((held > torch.as_tensor(self.caps, device=self.device)).any()):
            raise RuntimeError("recall: a head's region is full: compact() with more headroom")
        self.queued_recall.index_put_((r, p), self.queued_recall[r, p] | new)
        return int(new.sum())

    def queue_segments(self, rows: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor,
                       recall: torch.Tensor, release: torch.Tensor) -> None:
        """`recall(rows, positions, select=recall[segments])` then `release(rows, positions,
        select=release[segments])` (distinct pairs; recall/release (n_seg,) bool masks): with Triton moves in one
        launch, without the two gathered masks, captured or not (no host read: what has no host copy is not queued,
        and a recall past a head's room shows at the flush, raised by `check`, as in a graph's replay)."""
        if self.moves == "triton":
            from wnw_exp.kv.triton_moves import queue_segments

            queue_segments(rows, positions, segments, recall, release, self.slot_of, self.on_host,
                           self.queued_recall, self.queued_release)
            return
        self.recall(rows, positions, select=recall[segments])
        self.release(rows, positions, select=release[segments])

    def release(self, rows, positions, select=None) -> int | None:
        """Queue the release of resident positions with host copies (non-resident and already queued ones are
        skipped). Returns how many were queued, or None inside a graph capture."""
        r, p, sel = self._pairs(rows, positions, select)
        if _capturing() and self.moves == "triton":
            from wnw_exp.kv.triton_moves import queue_pairs

            queue_pairs(False, r, p, sel, self.slot_of, self.on_host, self.queued_release)
            return None
        new = (self.slot_of[r, p] >= 0) & ~self.queued_release[r, p]
        if sel is not None:
            new &= sel
        if not _capturing() and not bool(self.on_host[r, p][sel if sel is not None else slice(None)].all()):
            raise ValueError("release: a position without a host copy would be lost; drop it explicitly instead")
        self.queued_release.index_put_((r, p), self.queued_release[r, p] | (new & self.on_host[r, p]))
        return None if _capturing() else int(new.sum())

    def queue_pages(self, layer: int, page_of: torch.Tensor, codes: torch.Tensor) -> None:
        """`KVStore.queue_pages`; with Triton kernels in one launch (graph-safe), the same marks in the queues."""
        if self.kernels == "triton":
            from wnw_exp.kv.triton_moves import queue_pages

            queue_pages(codes, page_of, layer * codes.shape[0], self.slot_of, self.on_host, self.queued_recall,
                        self.queued_release)
            return
        KVStore.queue_pages(self, layer, page_of, codes)

    def _flush_blocks(self, movable: np.ndarray | None = None) -> dict:
        """Per flush scope (None: every layer; a layer), the rows that can move — those with a host copy, the only
        ones a recall or release may touch — (`host_rows`) and, for the PyTorch flush, their slots' index arrays
        (on the device at its first use, `_torch_block`); None where no row can move (Full, AdaKV: a flush is then
        free). `movable`: those rows, (L * H_kv,) bool, where the caller has read them already (else one host
        read)."""
        if self._blocks is None:
            if movable is None:
                movable = self.on_host.any(dim=1).cpu().numpy()
            H = self.n_kv_heads
            self._blocks = {}
            for key, (r0, r1) in [(None, (0, self.n_rows))] + [(li, (li * H, (li + 1) * H)) for li in range(self.n_layers)]:
                rows = r0 + np.flatnonzero(movable[r0:r1])
                if len(rows) == 0:
                    self._blocks[key] = None
                    continue
                self._blocks[key] = dict(host_rows=rows)
        return self._blocks

    def _torch_block(self, b: dict) -> dict:
        """A flush scope's index arrays on the device (rows, slots, row, local, start), made at the PyTorch flush's
        first use of the scope in one copy from pinned memory (the Triton flush never needs them)."""
        if "rows" not in b:
            rows = b["host_rows"]
            caps = self.caps[rows]
            start = np.cumsum(caps) - caps
            slots = np.repeat(self.base[rows] - start, caps) + np.arange(int(caps.sum()))
            h = dict(rows=rows, slots=slots, row=np.repeat(np.arange(len(rows)), caps),
                     local=np.arange(len(slots)) - np.repeat(start, caps), start=start)
            flat = to_device(np.concatenate([np.asarray(a, np.int64) for a in h.values()]), self.device)
            at = 0
            for k, a in h.items():
                b[k], at = flat[at:at + len(a)], at + len(a)
        return b

    def _flush_tables(self, layer: int | None):
        """The Triton flush of one scope of this store (`FlushTables` of one store), made at its first use."""
        b = self._flush_blocks()[layer]
        if b is not None and "tables" not in b:
            from wnw_exp.kv.triton_moves import FlushTables

            b["tables"] = FlushTables([(self, b["host_rows"])], self.device)
        return None if b is None else b["tables"]

    def flush(self, layer: int | None = None) -> None:
        """Apply the queued moves of one layer's heads (or of all): recalls into free slots, then releases.
        Fixed-shape tensor ops on the heads that can move; with the zero-copy kernel (CUDA + Triton) no host read."""
        b = self._flush_blocks()[layer]
        if b is None:
            return
        if self.moves == "triton":  # the same moves in two launches (kv/triton_moves.py; `flush_stores` for several)
            self._flush_tables(layer)()
            return
        N, dev = self.n_audio, self.device
        b = self._torch_block(b)
        rows, slots, row, local = b["rows"], b["slots"], b["row"], b["local"]
        n = len(rows)
        rec_q, rel_q = self.queued_recall[rows], self.queued_release[rows]
        pos = self.audio_pos[slots]  # (S,) the block's slots
        # 1. recalls: the k-th recalled position of a row (ascending) goes to its k-th free slot (ascending)
        rec = rec_q & (self.slot_of[rows] < 0)
        rank = rec.long().cumsum(dim=1) - 1  # (n, N)
        n_rec = rec.sum(dim=1)
        free = pos < 0
        cf = free.long().cumsum(0)
        before = torch.cat([cf.new_zeros(1), cf])[b["start"]]  # free slots before each row's first slot
        n_free = torch.cat([before[1:], cf[-1:]]) - before
        free_rank = cf - 1 - before[row]  # (S,) rank of a free slot among its row's free slots
        fill = free & (free_rank < n_rec[row])
        self.overflow += (n_rec - n_free).clamp(min=0).sum()
        # rank -> position per row (columns N.. take the other positions: every scatter target is distinct)
        cols = torch.arange(N, device=dev).expand(n, N)
        pos_for = torch.empty(n, 2 * N, device=dev, dtype=torch.int32)
        pos_for.scatter_(1, torch.where(rec, rank, N + cols), cols.int())
        got = pos_for.view(-1)[row * 2 * N + free_rank.clamp(min=0, max=N - 1)]
        self._copy_rows(fill, slots, self._host_row[rows][row] * N + got.long().clamp(min=0))
        pos = torch.where(fill, got, pos)
        self._recalled += fill.sum()
        # 2. releases: free the slots of the positions queued for release
        occupied = pos >= 0
        freed = occupied & rel_q.reshape(-1)[torch.where(occupied, row * N + pos.long(), 0)]
        pos = pos.masked_fill(freed, -1)
        self.audio_pos.index_copy_(0, slots, pos)
        self.queued_recall.index_fill_(0, rows, False)
        self.queued_release.index_fill_(0, rows, False)
        # 3. the block's bookkeeping, rebuilt from its slots
        occupied = pos >= 0
        slot_of = torch.full((n * N + len(pos),), -1, device=dev, dtype=torch.int32)  # free slots: distinct spares
        slot_of.scatter_(0, torch.where(occupied, row * N + pos.long(), n * N + torch.arange(len(pos), device=dev)),
                         local.int())
        self.slot_of.index_copy_(0, rows, slot_of[: n * N].view(n, N))
        self.n_resident.index_copy_(0, rows, torch.zeros(n, device=dev, dtype=torch.int64).index_add_(0, row, occupied.long()))
        high = torch.where(occupied, local + 1, 0)  # each head's scan length: one past its highest occupied slot
        hw = torch.zeros(n, device=dev, dtype=torch.int64).scatter_reduce_(0, row, high, "amax")
        self.audio_len.view(-1).index_copy_(0, rows, hw.int())

    def _copy_rows(self, fill: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
        """audio_k/v[slots[i]] = host mirror row src[i] for the slots i that a flush `fill`s (a host read)."""
        D = self.head_dim
        where = fill.nonzero().view(-1)
        if len(where) == 0:
            return
        src, dst = src[where].cpu(), slots[where]
        self.audio_k.index_copy_(0, dst, self.host_k.view(-1, D)[src].to(self.device, non_blocking=True))
        self.audio_v.index_copy_(0, dst, self.host_v.view(-1, D)[src].to(self.device, non_blocking=True))

    def check(self) -> None:
        """Raise if a flush ever found a head's free slots too few for its recalls (a host read)."""
        self._raise_overflow(int(self.overflow))

    @staticmethod
    def _raise_overflow(n: int) -> None:
        if n:
            raise RuntimeError(f"recall: a head's region is full ({n} rows did not fit): compact() with more headroom")

    # --- attention ----------------------------------------------------------------------------
    def attend_device(self, layer: int, q: torch.Tensor, scale: float, observe: torch.Tensor | None = None,
                      probs_out: torch.Tensor | None = None, accumulate: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of one layer over the state as it is (the step's key already appended at `dense_len`, read
        up to `dense_len_next`). Graph-safe. With `observe`: `probs_out` gets the observer heads' softmax weights
        at audio positions; or, with `accumulate` (n_audio,), their sum over the heads is added to it instead
        (with Triton kernels in one launch through `slot_of`, `probs_out` left alone)."""
        H = self.n_kv_heads
        rows = slice(layer * H, (layer + 1) * H)
        fn, summer = attention_torch, None
        if self.kernels == "triton":
            from wnw_exp.kv.triton_attention import decode_attention as fn

            if observe is not None and accumulate is not None:
                summer = self._observer_sum(layer, rows, observe, accumulate)
        dk, dv = self._dense(layer)
        out = fn(q, dk, dv, self.dense_len_next, self.audio_k, self.audio_v, self._offsets[rows],
                 self.audio_len[layer], scale, max_audio_per_head=self._max_cap, audio_pos=self.audio_pos,
                 observe=None if summer is not None else observe, probs_out=probs_out, scratch=self._scratch[layer])
        if summer is not None:
            summer(q, self.audio_k, self._offsets[rows], self._scratch[layer]["lse"], scale)
        elif observe is not None and accumulate is not None:  # the specification: the weights, then their sum
            accumulate += probs_out.sum(dim=0)
        return out

    def _observer_sum(self, layer: int, rows: slice, observe: torch.Tensor, accumulate: torch.Tensor):
        """The layer's `ObserverSum` for these tensors: made at the first (eager) step of a sample, then reused."""
        from wnw_exp.kv.triton_attention import ObserverSum

        key = (accumulate.data_ptr(), observe.data_ptr(), self.slot_of.data_ptr())
        held = self._observer_sums.get(layer)
        if held is None or held[0] != key:
            held = self._observer_sums[layer] = (key, ObserverSum(
                [(0, accumulate, self.slot_of[rows], observe.tolist())], self.device))
        return held[1]

    def _dense(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's dense K and V, (H_kv, n_text + dense_capacity, D): the store's own buffers, or in a pool its
        pages gathered (rows past the pages held read pool row 0..: garbage that the lengths mask; graph-safe)."""
        if self.pool is None:
            return self.dense_k[layer], self.dense_v[layer]
        H = self.n_kv_heads
        rows = self._dense_rows(torch.arange(self.dense_rows_max, device=self.device), slice(layer * H, (layer + 1) * H))
        return self.pool.k[rows], self.pool.v[rows]

    def append_dense(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write the step's key/value (H_kv, D) at the device-side dense length (graph-safe; no host read)."""
        if self.pool is not None:  # its page must be there (`ensure_dense`)
            H = self.n_kv_heads
            rows = self._dense_rows(self.dense_len, slice(layer * H, (layer + 1) * H)).view(H)
            self.pool.k.index_copy_(0, rows, k_new)
            self.pool.v.index_copy_(0, rows, v_new)
            return
        self.dense_k[layer].index_copy_(1, self.dense_len, k_new[:, None])
        self.dense_v[layer].index_copy_(1, self.dense_len, v_new[:, None])

    def dense_keys(self, layer: int) -> torch.Tensor:
        """(H_kv, n, D) the layer's non-audio keys so far (after RoPE), cut at the host's count of them (`_dense_n`:
        no wait for the device; exact on eager steps, which is where a policy that reads them runs, it being
        not graph-safe)."""
        if _capturing():
            raise RuntimeError("dense_keys: the host's count of the dense keys does not follow graph replays")
        return self._dense(layer)[0][:, : self._dense_n]

    def attend(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, scale: float,
               observe: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The reference's `attend`, eagerly (one layer; the dense length advances after the last layer)."""
        self.flush(layer)
        if self.pool is not None:
            if not self.ensure_dense(self._dense_n + 1):
                raise PoolFull("the KV pool has no free block for the stream's next dense page")
        elif self._dense_n >= self.dense_k.shape[2]:
            raise RuntimeError("dense KV capacity exhausted: raise the engine's max_new_tokens capacity")
        self.append_dense(layer, k_new, v_new)
        obs = probs = None
        if observe:
            obs = torch.tensor(observe, dtype=torch.int32, device=self.device)
            probs = torch.empty(len(observe), self.n_audio, device=self.device)
        out = self.attend_device(layer, q, scale, obs, probs)
        if layer == self.n_layers - 1:
            self.advance()
        return out, probs

    def advance(self) -> None:
        """The step's token is in every layer's dense part: the next step appends after it (graph-safe; the host
        count `_dense_n`, which only the eager `attend` reads, follows eager steps)."""
        advance_stores([self])

    # --- accounting (§3.4) --------------------------------------------------------------------
    def record_step(self) -> None:
        """Close a decode step on the device: its resident audio tokens and the rows recalled so far (graph-safe;
        the moves it queued must be flushed first)."""
        if self.kernels == "triton":  # the same four updates in one launch (a table of one; `record_steps`)
            record_steps([self], self._record_held)
            return
        at = self._n_rec.view(1)
        self._rec_n_gpu.index_copy_(0, at, self.n_resident.sum().view(1))
        self._rec_rows.index_copy_(0, at, self._recalled.view(1))
        self._n_rec += 1

    def end_step(self) -> StepRecord:
        """Apply what is queued (a decision takes effect before the next step), record the step, return it."""
        self.flush()
        self.record_step()
        return self.steps[-1]

    @property
    def recalled_rows(self) -> int:
        """Audio rows recalled to the device so far, all heads (cumulative; the steps' h2d bytes count them). A host
        read: not inside a graph capture."""
        return int(self._recalled)

    @property
    def steps(self) -> list[StepRecord]:
        return self._steps(*to_host(self._n_rec, self._rec_n_gpu, self._rec_rows))  # (one host read)

    def read_records(self) -> HostRead:
        return HostRead(self.overflow, self._n_rec, self._rec_n_gpu, self._rec_rows)

    def records(self, read: HostRead | None = None) -> list[StepRecord]:
        overflow, *recs = (read or self.read_records()).get()
        self._raise_overflow(int(overflow))
        return self._steps(*recs)

    def _steps(self, n: torch.Tensor, n_gpu: torch.Tensor, rows: torch.Tensor) -> list[StepRecord]:
        n_gpu, rows = n_gpu[: int(n)].tolist(), rows[: int(n)].tolist()
        row_bytes = self.head_dim * 2 * torch.finfo(self.dtype).bits // 8
        union = self.n_gpu_cpu()
        return [StepRecord(g, union, (r - (rows[i - 1] if i else 0)) * row_bytes) for i, (g, r) in enumerate(zip(n_gpu, rows))]

    def n_gpu(self) -> int:
        return int(self.n_resident.sum())

    def n_gpu_cpu(self) -> int:
        # Recall and release move only positions with a host copy, so the union changes only in set_tiers.
        if self._union is None:
            self._union = int((self.slot_of >= 0).logical_or(self.on_host).sum())
        return self._union

    def audio_bytes_on_device(self) -> int:
        if self.extent is not None:  # views into the pool: the rows the extent gives the audio regions
            return sum(t.numel() * t.element_size() for t in (self.audio_k, self.audio_v, self.audio_pos)) \
                + self.audio_len.untyped_storage().nbytes()
        if self.audio_k is None:  # released to the pool: what it held until then
            return self._released_bytes
        return sum(t.untyped_storage().nbytes() for t in (self.audio_k, self.audio_v, self.audio_pos, self.audio_len))


def flush_stores(stores, held: dict | None = None, launch: bool = True) -> None:
    """Every store's `flush()`: those with Triton moves together, in one pair of launches (their `FlushTables`,
    kept in `held` between calls and rebuilt when the set of stores, or a store's layout, changes: build it
    outside a graph capture), the others (PyTorch moves) each by its own flush. `launch=False`: only build the
    tables (before a capture). With held["capacity"] (stores) the tables are made for that many stores and
    rewritten in place (`FlushTables.bind`) for another set, even an empty one: a graph captured over their
    launches replays for any set they hold (`engine.step.BatchedFusedStep` with a capacity)."""
    parts = []
    for st in stores:
        if st.moves != "triton":
            if launch:
                st.flush()
            continue
        b = st._flush_blocks()[None]
        if b is not None:  # (none of its heads can move: nothing to flush)
            parts.append((st, b))
    held = {} if held is None else held
    if not parts and "tables" not in held:
        return
    blocks = held.get("blocks")
    if blocks is None or len(blocks) != len(parts) or any(x is not b for x, (_, b) in zip(blocks, parts)):
        from wnw_exp.kv.triton_moves import FlushTables

        fparts = [(st, b["host_rows"]) for st, b in parts]
        tables = held.get("tables")
        if tables is None or tables.capacity is None or not tables.bind(fparts):
            held["tables"] = FlushTables(fparts, parts[0][0].device, capacity=held.get("capacity"))
        held["blocks"] = [b for _, b in parts]  # (kept alive with the tables: their identities stay unique)
    if launch:
        held["tables"]()


def queue_segments_stores(parts, held: dict | None = None, launch: bool = True) -> None:
    """Every `store.queue_segments(rows, positions, segments, recall, release)` of `parts` ((store, (rows,
    positions, segments), recall, release) per stream: a method's per-segment decision as masks): the stores with
    Triton moves together in one launch (their `SegmentQueueTables`, kept in `held` between calls and rebuilt when
    a tensor in them changes: build it outside a graph capture; with held["capacity"], rewritten in place as
    `flush_stores` does), the others each by its own. `launch=False`: only build the tables (before a capture)."""
    together = []
    for part in parts:
        if part[0].moves == "triton":
            together.append(part)
        elif launch:
            store, (rows, pos, seg), recall, release = part
            store.queue_segments(rows, pos, seg, recall, release)
    held = {} if held is None else held
    if not together and "queue" not in held:
        return
    from wnw_exp.kv.triton_moves import SegmentQueueTables

    held = {} if held is None else held
    tables = held.get("queue")
    if tables is None or tables.key != SegmentQueueTables.key_of(together):
        if tables is None or tables.capacity is None or not tables.bind(together):
            tables = held["queue"] = SegmentQueueTables(together, together[0][0].device, held.get("capacity"))
    if launch:
        tables()


class BatchLayout:
    """What a batched decode step's attention reads of its streams' packed stores (one `KVPool`), in buffers of
    `capacity` rows made once: each row's dense length (`dense_len` (C,) long; -1 for a row without a stream: its
    k/v are written nowhere and its attention reads no key), each (layer, row, KV head)'s first audio slot and scan
    length (`audio_off`, `audio_len` (L, C, H) int64 / int32) and dense page table (`table` (L, C, H, P) int32), and
    each layer's key bound (`max_keys`: it fixes the attention's grid). `bind(stores)` sets the rows (outside a
    graph capture); `gather()` reads the stores' lengths and page tables as they are now and `advance()` moves every
    store one token on, each one launch with Triton kernels (through an address table rewritten in place by `bind`,
    so a graph captured over them replays for another set of stores), a PyTorch loop otherwise."""

    def __init__(self, n_layers: int, n_kv_heads: int, capacity: int, device: torch.device, kernels: str):
        L, H, C = n_layers, n_kv_heads, capacity
        self.L, self.H, self.capacity, self.device, self.kernels = L, H, C, device, kernels
        self.dense_len = torch.full((C,), -1, device=device, dtype=torch.long)
        self.audio_len = torch.zeros(L, C, H, device=device, dtype=torch.int32)
        self.audio_off = torch.zeros(L, C, H, device=device, dtype=torch.int64)
        self.table = torch.zeros(L, C, H, 1, device=device, dtype=torch.int32)
        self.stores: list = []
        self.layouts: list = []
        self.max_keys = [1] * L
        self._rows = None
        if kernels == "triton":
            from wnw_exp.kv.triton_moves import AddressRows

            self._rows = AddressRows(C, 4, device)

    def bind(self, stores: list, round_keys: int = 1) -> bool:
        """Rows 0.. for `stores` (placed in one pool), the rest empty; each layer's key bound rounded up to a multiple
        of `round_keys`. True where a buffer had to be made anew (more dense pages than it had room for)."""
        L, H, C = self.L, self.H, self.capacity
        if len(stores) > C:
            raise ValueError(f"{len(stores)} streams for a batch layout of {C}")
        self.layouts = layouts = [s.attention_layout() for s in stores]  # (each store's, as bound)
        pages = max(lay.block_table.shape[2] for lay in layouts)
        grown = pages > self.table.shape[3]
        if grown:
            self.table = torch.zeros(L, C, H, 1 << (pages - 1).bit_length(), device=self.device, dtype=torch.int32)
        off = np.zeros((L, C, H), np.int64)
        for b, lay in enumerate(layouts):
            off[:, b] = lay.audio_off
        upload(self.audio_off, torch.from_numpy(off))
        keys = np.max([lay.dense_rows_max + np.asarray(lay.caps).reshape(L, -1).max(axis=1) for lay in layouts], axis=0)
        self.max_keys = [-(-int(k) // round_keys) * round_keys for k in keys]
        self.stores = list(stores)
        if self._rows is not None:
            rows = [[s._lens.data_ptr(), s.audio_len.data_ptr(), s.dense_table.data_ptr(), s.dense_table.shape[1]]
                    for s in stores]
            self._rows.write(rows, [t for s in stores for t in (s._lens, s.audio_len, s.dense_table)])
        else:
            self.dense_len.fill_(-1)
            self.audio_len.zero_()
        return grown

    def gather(self) -> None:
        """The stores' dense lengths, scan lengths and page tables into the buffers (graph-safe)."""
        if self._rows is not None:
            from wnw_exp.kv.triton_moves import gather_layout

            gather_layout(self._rows.ptrs, self.dense_len, self.audio_len, self.table)
            return
        L, H = self.L, self.H
        for b, s in enumerate(self.stores):
            self.dense_len[b : b + 1].copy_(s.dense_len)
            self.audio_len[:, b].copy_(s.audio_len)
            t = s.dense_table.view(L, H, -1)
            self.table[:, b, :, : t.shape[2]].copy_(t)

    def advance(self) -> None:
        """Every store one token on (`advance_stores`; graph-safe)."""
        if self._rows is not None:
            from wnw_exp.kv.triton_moves import advance_layout

            advance_layout(self._rows.ptrs)
            if not _capturing():
                for s in self.stores:
                    s._dense_n += 1
            return
        advance_stores(self.stores)


def advance_stores(stores) -> None:
    """Every store's `advance()` (a batch's streams): their device counts (dense_len and dense_len_next) in one
    launch; the host count `_dense_n`, which only the eager `attend` reads, follows eager steps."""
    torch._foreach_add_([s._lens for s in stores], 1)
    if not _capturing():
        for s in stores:
            s._dense_n += 1


def record_steps(stores, held: dict | None = None, launch: bool = True) -> None:
    """Every store's `record_step()`: those with Triton kernels together, in one launch (their `RecordTables`,
    kept in `held` between calls and rebuilt when a store's tensors change: build it outside a graph capture;
    with held["capacity"], rewritten in place as `flush_stores` does), the others each by its own. `launch=False`:
    only build the tables (before a capture)."""
    together = []
    for st in stores:
        if st.kernels == "triton":
            together.append(st)
        elif launch:
            st.record_step()
    held = {} if held is None else held
    if not together and "record" not in held:
        return
    from wnw_exp.kv.triton_moves import RecordTables

    tables = held.get("record")
    if tables is None or tables.key != RecordTables.key_of(together):
        if tables is None or tables.capacity is None or not tables.bind(together):
            tables = held["record"] = RecordTables(together, together[0].device, held.get("capacity"))
    if launch:
        tables()


def attention_torch(q: torch.Tensor, dense_k: torch.Tensor, dense_v: torch.Tensor, dense_len: torch.Tensor,
                    audio_k: torch.Tensor, audio_v: torch.Tensor, audio_off: torch.Tensor, audio_len: torch.Tensor,
                    scale: float, *, max_audio_per_head: int, audio_pos: torch.Tensor | None = None,
                    observe: torch.Tensor | None = None, probs_out: torch.Tensor | None = None,
                    scratch: dict | None = None) -> torch.Tensor:
    """`kv.triton_attention.decode_attention` in PyTorch (same arguments, same layout, no host reads): each head's
    first `audio_len` slots are gathered up to `max_audio_per_head` and masked by the device lengths and, when
    `audio_pos` is given, by the free slots (position -1)."""
    H_q, D = q.shape
    H, Cd = dense_k.shape[:2]
    G = H_q // H
    A = max(int(max_audio_per_head), 1)
    ar = torch.arange(A, device=q.device)
    idx = (audio_off.long()[:, None] + ar[None]).clamp(max=audio_k.shape[0] - 1)  # (H, A)
    k = torch.cat([dense_k, audio_k[idx]], dim=1).float()
    v = torch.cat([dense_v, audio_v[idx]], dim=1).float()
    in_audio = ar[None] < audio_len.view(H, 1)
    if audio_pos is not None:
        in_audio = in_audio & (audio_pos[idx] >= 0)
    valid = torch.cat([(torch.arange(Cd, device=q.device) < dense_len.view(1))[None].expand(H, Cd), in_audio], dim=1)
    v = v.masked_fill(~valid[..., None], 0.0)  # rows past the lengths are uninitialised memory (NaN * 0 = NaN)
    s = torch.einsum("hgd,hnd->hgn", q.view(H, G, D).float(), k) * scale
    s = s.masked_fill(~valid[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    out = torch.einsum("hgn,hnd->hgd", p, v).to(q.dtype).reshape(H_q, D)
    if observe is not None and len(observe):
        obs = observe.long()
        heads = obs // G
        w = p.reshape(H_q, Cd + A)[obs, Cd:] * valid[heads, Cd:]  # (n_obs, A), 0 where not resident
        probs_out.zero_()
        probs_out.scatter_add_(1, audio_pos[idx[heads]].long().clamp(min=0), w)
    return out


def attention_batched_torch(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, pool_pos: torch.Tensor,
                            dense_table: torch.Tensor, dense_len: torch.Tensor, audio_off: torch.Tensor,
                            audio_len: torch.Tensor, scale: float, *, max_keys: int, page_rows: int,
                            scratch: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`kv.triton_attention.decode_attention_batched` in PyTorch (same arguments and results): each (stream, KV
    head) gathers its dense rows (through its page table) and audio slots from the pool up to `max_keys`, masked
    by the device lengths and the free slots."""
    B, H_q, D = q.shape
    H, P = dense_table.shape[1:]
    G = H_q // H
    j = torch.arange(max(int(max_keys), 1), device=q.device)
    dlen = dense_len.long().view(B, 1, 1)
    in_d = j < dlen
    in_a = (j >= dlen) & (j < dlen + audio_len.long()[..., None])
    page = torch.gather(dense_table.long(), 2, (j // page_rows).clamp(max=P - 1).expand(B, H, -1))
    row = torch.where(in_d, page + j % page_rows, audio_off.long()[..., None] + j - dlen)
    row = row.clamp(0, pool_k.shape[0] - 1)
    in_a = in_a & (pool_pos[row] >= 0)
    ok = in_d | in_a  # (B, H, K)
    k = pool_k[row].float()
    v = pool_v[row].float().masked_fill(~ok[..., None], 0.0)  # rows past the lengths may hold anything
    s = torch.einsum("bhgd,bhkd->bhgk", q.view(B, H, G, D).float(), k) * scale
    s = s.masked_fill(~ok[:, :, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhgk,bhkd->bhgd", torch.exp(s - lse[..., None]), v)
    return out.to(q.dtype).reshape(B, H_q, D), lse.reshape(B, H_q)


def observed_probs_torch(q: torch.Tensor, pool_k: torch.Tensor, pool_pos: torch.Tensor, audio_off: torch.Tensor,
                         audio_len: torch.Tensor, lse: torch.Tensor, scale: float, observe: torch.Tensor,
                         probs_out: torch.Tensor, max_audio_per_head: int) -> torch.Tensor:
    """`kv.triton_attention.observed_probs` in PyTorch."""
    H_q, D = q.shape
    G = H_q // audio_off.shape[0]
    obs = observe.long()
    j = torch.arange(max(int(max_audio_per_head), 1), device=q.device)
    row = (audio_off.long()[obs // G, None] + j).clamp(max=pool_k.shape[0] - 1)  # (n_obs, A)
    pos = torch.where(j < audio_len.long()[obs // G, None], pool_pos[row], -1)
    s = torch.einsum("od,oad->oa", q[obs].float(), pool_k[row].float()) * scale
    w = torch.exp(s - lse[obs, None]) * (pos >= 0)
    probs_out.zero_()
    probs_out.scatter_add_(1, pos.long().clamp(min=0), w)
    return probs_out
