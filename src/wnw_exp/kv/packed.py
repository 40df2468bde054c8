"""A CUDA fast path for the KV-tier store: fixed-capacity packed device buffers, device-side lengths,
the Triton decode kernel, and recall on a side stream from a pinned host mirror.

Same interface and accounting as `AudioKVStore` (the reference): write_prefill, set_tiers, recall,
release, attend, end_step, summary. What differs is only where bytes live:
- dense part: one (L, H_kv, C_dense, D) buffer; one device counter `dense_len` shared by all layers
  (every layer sees the same non-audio tokens).
- audio part: one flat (Σ cap_r, D) buffer; (layer, head) = row r owns the slots [base_r, base_r + cap_r)
  of which the first `audio_len[l, h]` (a device int32 tensor) are resident. Row order inside a head is free
  (attention is order-free); `audio_pos` says which audio position each row holds.
- host tier: a pinned mirror of every audio K/V written at prefill (ArkVale-style); which positions
  are recallable is tracked per head, exactly as in the reference.
`compact(headroom)` after prefill shrinks every head's capacity to its own resident count, plus `headroom`
rows for heads with a recallable host tier, so the device memory held really drops (the old buffer is
freed, not masked) even when some heads (WnW's anchors) keep all their audio.

Moves are queued, never synchronised with the host: `recall` gathers host rows into a pinned staging
buffer and copies them on a side stream into free rows past a head's length; `release` only marks rows.
`flush()` (called by `attend` for its layer, or once per step before a captured graph replays) makes the
compute stream wait for the copies and applies both with one gather/scatter and one length update.
"""

from __future__ import annotations

import numpy as np
import torch

from wnw_exp.kv.store import StepAccounting, StepRecord


class PackedAudioKVStore(StepAccounting):
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_audio: int, device: torch.device,
                 dtype: torch.dtype, dense_capacity: int):
        self.n_layers, self.n_kv_heads, self.head_dim, self.n_audio = n_layers, n_kv_heads, head_dim, n_audio
        self.device, self.dtype, self.dense_capacity = torch.device(device), dtype, dense_capacity
        L, H, D = n_layers, n_kv_heads, head_dim
        self.caps = np.full(L * H, n_audio, np.int64)  # slots each (layer, head) owns
        self.base = np.concatenate([[0], np.cumsum(self.caps)])  # first slot of each (layer, head)
        self._layout = 0  # bumped when the slots move (cache key of the device offsets)
        self.audio_k = torch.empty(L * H * n_audio, D, device=device, dtype=dtype)
        self.audio_v = torch.empty_like(self.audio_k)
        self.audio_pos = torch.empty(L * H * n_audio, device=device, dtype=torch.int32)
        self.audio_len = torch.zeros(L, H, device=device, dtype=torch.int32)
        self.host_k = torch.empty(L, H, n_audio, D, dtype=dtype, pin_memory=self.device.type == "cuda")
        self.host_v = torch.empty_like(self.host_k, pin_memory=self.device.type == "cuda")
        # Host bookkeeping, vectorised over (layer, head) = row r = l*H + h; no device reads ever.
        self.row_pos = np.tile(np.arange(n_audio, dtype=np.int64), (L * H, 1))  # slot -> position
        self.slot_of = self.row_pos.copy()  # position -> slot (valid where resident)
        self.n_rows = np.full(L * H, n_audio, np.int64)
        self.resident = np.ones((L * H, n_audio), bool)
        self.on_host = np.zeros((L * H, n_audio), bool)
        self._union: int | None = None
        self.dense_k: torch.Tensor | None = None
        self.dense_v: torch.Tensor | None = None
        self.dense_len = torch.zeros(1, device=device, dtype=torch.long)
        self._dense_n = 0  # host copy of dense_len for the eager path
        self.layer_audio = [n_audio] * L
        self.steps: list[StepRecord] = []
        self._h2d_this_step = 0
        # Queued moves, flat: one entry per (row, position). Recalls: (rows, pos, slots); releases: (rows, pos).
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._releases: list[tuple[np.ndarray, np.ndarray]] = []
        self._queued_mask = np.zeros((L * H, n_audio), bool)  # recall queued, not yet applied
        self._release_mask = np.zeros((L * H, n_audio), bool)  # release queued, not yet applied
        self._scratch_mask = np.zeros((L * H, n_audio), bool)  # all False between uses (flush)
        self._n_issued = 0
        self._events: list = []
        self._compacted = None
        self._queued_n = np.zeros(n_layers * n_kv_heads, np.int64)
        self.side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._staging: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._scratch: list[dict] = [{} for _ in range(L)]

    # --- writing ------------------------------------------------------------------------------
    def write_prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor, audio_span: tuple[int, int]) -> None:
        s, e = audio_span
        assert e - s == self.n_audio, "token merging (affpool) is not supported by the packed store"
        H, D = self.n_kv_heads, self.head_dim
        dk = torch.cat([k[:, :s], k[:, e:]], dim=1)
        if self.dense_k is None:
            n = dk.shape[1]
            self.dense_k = torch.empty(self.n_layers, H, n + self.dense_capacity, D, device=self.device, dtype=self.dtype)
            self.dense_v = torch.empty_like(self.dense_k)
            self._dense_n = n
            self.dense_len.fill_(n)
        self.dense_k[layer, :, : self._dense_n] = dk
        self.dense_v[layer, :, : self._dense_n] = torch.cat([v[:, :s], v[:, e:]], dim=1)
        base, n = int(self.base[layer * H]), self.n_audio  # before compact() every head owns n_audio slots
        self.audio_k[base: base + H * n].view(H, n, D).copy_(k[:, s:e])
        self.audio_v[base: base + H * n].view(H, n, D).copy_(v[:, s:e])
        self.audio_pos[base: base + H * n] = torch.arange(n, device=self.device, dtype=torch.int32).repeat(H)
        self.audio_len[layer] = self.n_audio
        self.host_k[layer].copy_(k[:, s:e], non_blocking=True)
        self.host_v[layer].copy_(v[:, s:e], non_blocking=True)

    def set_tiers(self, layer: int, head: int, gpu: torch.Tensor, cpu: torch.Tensor | None = None) -> None:
        """Keep `gpu` positions resident, make `cpu` recallable, drop the rest (as the reference)."""
        r = layer * self.n_kv_heads + head
        gpu = np.sort(np.asarray(gpu.detach().cpu(), np.int64))
        if not self.resident[r, gpu].all():
            raise ValueError("set_tiers: a position to keep is not GPU-resident")
        on_host = np.zeros(self.n_audio, bool)
        if cpu is not None and len(cpu):
            cpu = np.asarray(cpu.detach().cpu(), np.int64)
            if not self.resident[r, cpu].all():
                raise ValueError("set_tiers: a position to offload is not GPU-resident")
            on_host[cpu] = True  # may overlap `gpu`: a host mirror of resident positions (ArkVale)
        base = int(self.base[r])
        src = torch.as_tensor(base + self.slot_of[r, gpu], device=self.device)
        dst = torch.arange(base, base + len(gpu), device=self.device)
        self.audio_k[dst] = self.audio_k[src]  # the right side is gathered first: no overlap hazard
        self.audio_v[dst] = self.audio_v[src]
        self.audio_pos[dst] = torch.as_tensor(gpu, device=self.device, dtype=torch.int32)
        self.on_host[r] = on_host
        self.resident[r] = False
        self.resident[r, gpu] = True
        self.row_pos[r, : len(gpu)] = gpu
        self.slot_of[r, gpu] = np.arange(len(gpu))
        self.n_rows[r] = len(gpu)
        self.audio_len[layer, head] = len(gpu)
        self._union = None

    def compact(self, headroom: int | np.ndarray = 0) -> None:
        """Shrink each head's region to its resident count, + `headroom` rows where it can recall (frees memory).
        `headroom`: one count for every head, or one per row (L * H_kv,) = layer * H_kv + head (WnW sizes each
        tidal head's room by what its recalls can hold at once). A recall past a head's room raises."""
        headroom = np.asarray(headroom, np.int64)
        if headroom.ndim and headroom.shape != self.n_rows.shape:
            raise ValueError(f"compact: headroom has shape {headroom.shape}, expected () or {self.n_rows.shape}")
        recallable = self.on_host.any(axis=1)  # heads that never recall (anchors, fixed heads) need no headroom
        new_caps = np.minimum(self.n_audio, self.n_rows + np.where(recallable, headroom, 0))
        if np.array_equal(new_caps, self.caps):
            return
        keep = np.concatenate([np.arange(b, b + c) for b, c in zip(self.base[:-1], new_caps)])
        idx = torch.from_numpy(keep).to(self.device)
        self.audio_k = self.audio_k[idx]  # new, exactly sized tensors: the old buffer is freed
        self.audio_v = self.audio_v[idx]
        self.audio_pos = self.audio_pos[idx]
        self.caps = new_caps
        self.base = np.concatenate([[0], np.cumsum(new_caps)])
        self._layout += 1

    # --- moving between tiers -----------------------------------------------------------------
    def recall(self, layer: int, head: int, positions) -> int:
        """Queue host-resident positions for copying back (skips resident and already queued ones)."""
        pos = np.unique(_np(positions))
        return self.recall_rows(np.full(len(pos), layer * self.n_kv_heads + head), pos)

    def recall_rows(self, rows: np.ndarray, pos: np.ndarray) -> int:
        """`recall` for many heads at once: flat arrays, row = layer * H_kv + head, one entry per position
        (distinct pairs). Resident and already queued pairs are skipped; returns how many were queued."""
        rows, pos = np.asarray(rows, np.int64), np.asarray(pos, np.int64)
        new = ~self.resident[rows, pos] & ~self._queued_mask[rows, pos]
        rows, pos = rows[new], pos[new]
        if len(pos):
            self._queue_recall(rows, pos)
        return len(pos)

    def recall_batch(self, rows: np.ndarray, pos: np.ndarray) -> None:
        """Queue recalls for many heads at once: rows (n,) distinct, = layer*H_kv + head; pos (n, c) not
        resident and not queued (the per-head `recall` checks that; this fast path trusts the caller)."""
        self._queue_recall(np.repeat(rows, pos.shape[1]), pos.ravel())

    def _queue_recall(self, rows: np.ndarray, pos: np.ndarray) -> None:
        if not self.on_host[rows, pos].all():
            raise ValueError("recall: positions have no host copy (they were dropped)")
        counts = np.bincount(rows, minlength=len(self.caps))
        if (self.n_rows + self._queued_n + counts > self.caps).any():
            raise RuntimeError("recall: a head's region is full: compact() with more headroom")
        order = np.argsort(rows, kind="stable")  # rank of each entry among its row's entries
        rank = np.empty(len(rows), np.int64)
        starts = np.concatenate([[0], np.cumsum(counts)])[rows[order]]
        rank[order] = np.arange(len(rows)) - starts
        slots = self.n_rows[rows] + self._queued_n[rows] + rank
        self._queued_n += counts
        self._queued_mask[rows, pos] = True
        self._pending.append((rows, pos, slots))

    def release(self, layer: int, head: int, positions) -> int:
        pos = np.unique(_np(positions))
        r = layer * self.n_kv_heads + head
        if not self.on_host[r, pos].all():
            raise ValueError("release: a position without a host copy would be lost; drop it explicitly instead")
        return self.release_rows(np.full(len(pos), r), pos)

    def release_rows(self, rows: np.ndarray, pos: np.ndarray) -> int:
        """`release` for many heads at once (flat, distinct pairs with host copies); non-resident and already
        queued pairs are skipped. Returns how many were queued."""
        rows, pos = np.asarray(rows, np.int64), np.asarray(pos, np.int64)
        if not self.on_host[rows, pos].all():
            raise ValueError("release: a position without a host copy would be lost; drop it explicitly instead")
        keep = self.resident[rows, pos] & ~self._release_mask[rows, pos]
        if keep.any():
            self.release_batch(rows[keep], pos[keep])
        return int(keep.sum())

    def release_batch(self, rows: np.ndarray, pos: np.ndarray) -> None:
        """Queue releases of resident positions with host copies: flat rows/pos, or rows (n,) with pos (n, c)."""
        if pos.ndim == 2:
            rows, pos = np.repeat(rows, pos.shape[1]), pos.ravel()
        self._release_mask[rows, pos] = True
        self._releases.append((rows, pos))

    def issue(self) -> None:
        """Start the queued recalls' copies on the side stream (call as soon as the decision is made)."""
        todo = self._pending[self._n_issued:]
        if not todo:
            return
        D = self.head_dim
        rows = np.concatenate([r for r, _, _ in todo])
        pos = np.concatenate([p for _, p, _ in todo])
        dst = np.concatenate([self.base[r] + sl for r, _, sl in todo])
        n = len(pos)
        pin = self.device.type == "cuda"
        # Double-buffered pinned staging: the host waits only for the copy that used this buffer before.
        self._slot = 1 - getattr(self, "_slot", 0)
        while len(self._staging) <= self._slot:
            self._staging.append((torch.empty(0, 2, D, dtype=self.dtype), None))
        buf, ev = self._staging[self._slot]
        if ev is not None:
            ev.synchronize()
        if buf.shape[0] < n:
            buf = torch.empty(max(n, 2 * buf.shape[0]), 2, D, dtype=self.dtype, pin_memory=pin)
        idx = torch.from_numpy(rows * self.n_audio + pos)
        torch.index_select(self.host_k.view(-1, D), 0, idx, out=buf[:n, 0])
        torch.index_select(self.host_v.view(-1, D), 0, idx, out=buf[:n, 1])
        meta = torch.from_numpy(np.stack([dst, pos]))
        if pin:
            meta = meta.pin_memory()
        done = None
        with (torch.cuda.stream(self.side) if pin else _null()):
            if pin and self._compacted is not None:
                # The rows written lie past every length, so the step in flight never reads them; only the
                # last compaction (which read tail rows as sources) must be done. Never wait for the step.
                self.side.wait_event(self._compacted)
            dev = buf[:n].to(self.device, non_blocking=True)
            m = meta.to(self.device, non_blocking=True)
            self.audio_k.index_copy_(0, m[0], dev[:, 0])
            self.audio_v.index_copy_(0, m[0], dev[:, 1])
            self.audio_pos.index_copy_(0, m[0], m[1].to(torch.int32))
            if pin:
                done = torch.cuda.Event()
                done.record(self.side)
        self._staging[self._slot] = (buf, done)
        self._h2d_this_step += n * D * 2 * buf.element_size()
        self._events.append((done, dev, m))  # device temporaries stay alive until the wait
        self._n_issued = len(self._pending)

    def flush(self) -> None:
        """Make queued recalls and releases visible to attention: wait for the copies, compact, update lengths."""
        if not self._pending and not self._releases:
            return
        self.issue()
        for done, *_ in self._events:
            if done is not None:
                torch.cuda.current_stream(self.device).wait_event(done)
        for rows, pos, slots in self._pending:
            self.row_pos[rows, slots] = pos
            self.slot_of[rows, pos] = slots
            self.resident[rows, pos] = True
            self._queued_mask[rows, pos] = False
            self.n_rows += np.bincount(rows, minlength=len(self.n_rows))
        self._pending, self._n_issued, self._events = [], 0, []
        self._queued_n[:] = 0
        src, dst = [], []
        if self._releases:  # swap-remove: the last kept rows of each head move into its holes
            rows = np.concatenate([r for r, _ in self._releases])
            pos = np.concatenate([p for _, p in self._releases])
            self._releases = []
            self._release_mask[rows, pos] = False
            new_n = self.n_rows - np.bincount(rows, minlength=len(self.n_rows))
            holes = self.slot_of[rows, pos]
            fill = holes < new_n[rows]  # holes inside the kept range need a row moved in
            # The slots that fall off each head's end: [new_n, n_rows); those that are not holes move.
            cnt = self.n_rows - new_n
            t_rows = np.repeat(np.arange(len(cnt)), cnt)
            t_slot = new_n[t_rows] + np.arange(len(t_rows)) - np.repeat(np.cumsum(cnt) - cnt, cnt)
            is_hole = self._scratch_mask  # (rows, holes) marked, read at the tail slots, cleared again
            is_hole[rows, holes] = True
            mover = ~is_hole[t_rows, t_slot]
            is_hole[rows, holes] = False
            f_rows, f_slot = rows[fill], holes[fill]
            o = np.argsort(f_rows * (self.n_audio + 1) + f_slot)  # both sides in (row, slot) order (pairs distinct)
            f_rows, f_slot = f_rows[o], f_slot[o]
            m_rows, m_slot = t_rows[mover], t_slot[mover]  # already in (row, slot) order
            moved_pos = self.row_pos[m_rows, m_slot]
            self.resident[rows, pos] = False
            self.row_pos[f_rows, f_slot] = moved_pos
            self.slot_of[f_rows, moved_pos] = f_slot
            self.n_rows = new_n
            src.append(self.base[m_rows] + m_slot)
            dst.append(self.base[f_rows] + f_slot)
        if src and sum(len(x) for x in src):
            s = torch.from_numpy(np.concatenate(src)).to(self.device, non_blocking=True)
            d = torch.from_numpy(np.concatenate(dst)).to(self.device, non_blocking=True)
            self.audio_k.index_copy_(0, d, self.audio_k[s])
            self.audio_v.index_copy_(0, d, self.audio_v[s])
            self.audio_pos.index_copy_(0, d, self.audio_pos[s])
        lens = torch.from_numpy(self.n_rows.astype(np.int32)).view(self.n_layers, self.n_kv_heads)
        self.audio_len.copy_(lens.pin_memory() if self.device.type == "cuda" else lens, non_blocking=True)
        if self.device.type == "cuda":
            self._compacted = torch.cuda.Event()
            self._compacted.record(torch.cuda.current_stream(self.device))

    # --- attention ----------------------------------------------------------------------------
    def offsets(self, layer: int) -> torch.Tensor:
        key = ("off", layer, self._layout)
        if key not in self._scratch[layer]:
            H = self.n_kv_heads
            self._scratch[layer][key] = torch.as_tensor(self.base[layer * H:(layer + 1) * H], dtype=torch.int32,
                                                        device=self.device)
        return self._scratch[layer][key]

    def append_dense(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write the step's key/value at the device-side dense length (graph-safe; no host read)."""
        self.dense_k[layer].index_copy_(1, self.dense_len, k_new[:, None])
        self.dense_v[layer].index_copy_(1, self.dense_len, v_new[:, None])

    def dense_keys(self, layer: int) -> torch.Tensor:
        """(H_kv, n, D) the layer's non-audio keys so far (after RoPE)."""
        return self.dense_k[layer, :, : self._dense_n]

    def attend_device(self, layer: int, q: torch.Tensor, scale: float, observe: torch.Tensor | None = None,
                      probs_out: torch.Tensor | None = None) -> torch.Tensor:
        """Kernel call over the state as it is (dense_len already counts the new token). Graph-safe."""
        from wnw_exp.kv.triton_attention import decode_attention

        dl = self._scratch[layer].setdefault("dlen_plus", torch.zeros(1, device=self.device, dtype=torch.long))
        torch.add(self.dense_len, 1, out=dl)
        return decode_attention(q, self.dense_k[layer], self.dense_v[layer], dl, self.audio_k, self.audio_v,
                                self.offsets(layer), self.audio_len[layer], scale, max_audio_per_head=int(self.caps.max()),
                                audio_pos=self.audio_pos, observe=observe, probs_out=probs_out,
                                scratch=self._scratch[layer])

    def attend(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, scale: float,
               observe: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The reference's `attend`, eagerly (one layer; the dense length advances after the last layer)."""
        self.flush()
        if self._dense_n >= self.dense_k.shape[2]:
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
        self.dense_len += 1
        self._dense_n += 1

    # --- accounting (§3.4), from the host bookkeeping: no device reads --------------------------
    @property
    def n_full(self) -> int:
        return self.n_layers * self.n_kv_heads * self.n_audio

    def n_gpu(self) -> int:
        # Queued moves count as done, as in the reference store, where recall/release act at once.
        return int(self.n_rows.sum() + self._queued_n.sum() - sum(len(p) for _, p in self._releases))

    def n_gpu_cpu(self) -> int:
        # Recall and release move only positions with a host copy, so the union changes only in set_tiers.
        if self._union is None:
            self._union = int((self.resident | self.on_host).sum())
        return self._union

    def audio_bytes_on_device(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in (self.audio_k, self.audio_v, self.audio_pos, self.audio_len))


def _np(positions) -> np.ndarray:
    return np.asarray(positions.detach().cpu() if torch.is_tensor(positions) else positions, np.int64).ravel()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
