"""One allocation of device KV rows shared by the streams of a batch (issue 16).

A `KVPool` is two (n_blocks * block, D) tensors, K and V, allocated once: the fixed GPU memory budget a server
decodes in. A stream's store asks for one contiguous extent of whole blocks when its prefill is placed (each
head's resident audio plus its recall room) and for single blocks, its dense pages, as its text grows (the prompt's
text at placement, then one page per (layer, KV head) each time `block` generated tokens have filled the last:
`alloc_blocks`); all of it goes back when the stream leaves. `alloc` returns None when no free run of blocks is
long enough, `alloc_blocks` None when fewer blocks are free than asked: the caller (the engine's admission, or
its preemption of a stream) decides, nothing is overcommitted. First fit over a sorted free list; neighbouring free
runs merge on `free`.

The pool also holds each row's audio position (`pos`, int32, -1 for a free slot or a dense row), so one
attention launch over every stream of a batch reads positions as it reads keys: by pool row. Only the K/V rows
and those positions live here (they are >= 97% of a stream's device bytes at 3,000 audio tokens); each store's
small bookkeeping tensors (slot tables, masks, positions) are its own allocations.

Host memory: the pinned host mirrors of the streams whose method keeps a CPU tier (`host_buffer`) come out of a host
arena pinned once when the pool is made (`host_bytes`, where a server pays its start-up costs), as a server keeps its
swap space: pinning hundreds of MB for each request costs more than its prefill (`cudaHostAlloc` maps and locks
every page). The arena is cut into `HOST_UNIT`-byte units handed out by the same first-fit allocator as the device
blocks, so mirrors of any size (the audio length varies per request) share it and go back to it when their stream
leaves. Where the arena has no room a mirror is pinned on its own, and kept when its stream leaves for the next
stream of the same shape.
"""

from __future__ import annotations

import bisect
import heapq
import math
from typing import NamedTuple

import numpy as np
import torch


class Extent(NamedTuple):  # (a tuple: a stream's dense pages make thousands of them)
    block: int  # first block
    n_blocks: int
    start: int  # first row (block * rows per block)
    n_rows: int  # rows asked for (<= n_blocks * rows per block)


class PoolFull(RuntimeError):
    """A request's KV does not fit the pool's free blocks."""


HOST_UNIT = 1 << 16  # bytes: the host arena's allocation unit (a mirror takes whole units)


class FirstFit:
    """Runs of consecutive units out of `n` (the pool's device blocks, or its host arena's units): first fit over a
    sorted free list of runs; neighbouring free runs merge when a run is given back. Counts the units in use and
    their peak."""

    def __init__(self, n: int):
        self.n = n
        self.runs: list[tuple[int, int]] = [(0, n)] if n else []  # (first unit, length), sorted, never adjacent
        self.used = self.peak = 0

    def fits(self, need: int) -> bool:
        return any(m >= need for _, m in self.runs)

    def _took(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)

    def take(self, need: int) -> int | None:
        """The first unit of a run of `need` consecutive units (the first free run long enough), or None."""
        for i, (b, n) in enumerate(self.runs):
            if n >= need:
                if n == need:
                    del self.runs[i]
                else:
                    self.runs[i] = (b + need, n - need)
                self._took(need)
                return b
        return None

    def take_singles(self, n: int) -> list[int] | None:
        """`n` units, not necessarily consecutive, lowest first, or None (nothing taken) where fewer are free."""
        if n > self.n - self.used:
            return None
        out: list[int] = []
        while len(out) < n:
            b, m = self.runs[0]
            take = min(m, n - len(out))
            if take == m:
                del self.runs[0]
            else:
                self.runs[0] = (b + take, m - take)
            out.extend(range(b, b + take))
        self._took(n)
        return out

    def give(self, b: int, n: int) -> None:
        """Give back the run of `n` units from `b` (taken before)."""
        self.used -= n
        i = bisect.bisect_left(self.runs, (b, 0))
        if i < len(self.runs) and b + n == self.runs[i][0]:  # merge with the next free run
            n += self.runs.pop(i)[1]
        if i > 0 and self.runs[i - 1][0] + self.runs[i - 1][1] == b:  # and with the previous one
            b, n = self.runs[i - 1][0], self.runs[i - 1][1] + n
            self.runs[i - 1] = (b, n)
        else:
            self.runs.insert(i, (b, n))

    def give_many(self, starts, lengths) -> None:
        """`give` of many runs at once (a leaving stream's pages): the runs coalesced, then merged into the free
        list in one pass (one `give` each costs a search and a list insertion per run)."""
        starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
        if not len(starts):
            return
        order = np.argsort(starts, kind="stable")
        starts, lengths = starts[order], lengths[order]
        self.used -= int(lengths.sum())
        ends = starts + lengths
        new_run = np.ones(len(starts), bool)
        new_run[1:] = starts[1:] != ends[:-1]  # a run that does not continue the previous one
        first = np.flatnonzero(new_run)
        last = np.append(first[1:], len(starts)) - 1
        given = list(zip(starts[first].tolist(), (ends[last] - starts[first]).tolist()))
        out: list[tuple[int, int]] = []
        for b, n in heapq.merge(self.runs, given):
            if out and out[-1][0] + out[-1][1] == b:
                out[-1] = (out[-1][0], out[-1][1] + n)
            else:
                out.append((b, n))
        self.runs = out


class KVPool:
    def __init__(self, n_rows: int, head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 block: int = 64, host_bytes: int = 0):
        """`n_rows` K/V rows of `head_dim` in blocks of `block` rows on `device`; `host_bytes`: the host arena the
        streams' host mirrors come from, pinned here where the pool is on CUDA (0: none, every mirror is pinned
        when its stream is placed)."""
        if n_rows < block or block < 1:
            raise ValueError(f"a KV pool needs at least one block of {block} rows (asked for {n_rows} rows)")
        if host_bytes < 0:
            raise ValueError(f"host_bytes must be >= 0 (got {host_bytes})")
        self.block, self.head_dim, self.dtype, self.device = block, head_dim, dtype, torch.device(device)
        self.n_blocks = n_rows // block
        self.k = torch.empty(self.n_blocks * block, head_dim, device=self.device, dtype=dtype)
        self.v = torch.empty_like(self.k)
        self.pos = torch.full((self.n_blocks * block,), -1, device=self.device, dtype=torch.int32)  # audio slots' positions
        self._blocks = FirstFit(self.n_blocks)
        self._live: dict[int, Extent] = {}  # extents handed out, by first block
        self.n_refused = 0
        pin = self.device.type == "cuda"
        self._arena = FirstFit(int(host_bytes) // HOST_UNIT)
        self.host_arena = torch.empty(self._arena.n * HOST_UNIT, dtype=torch.uint8, pin_memory=pin and self._arena.n > 0)
        self._arena_live: dict[int, tuple[int, int]] = {}  # buffers handed out of the arena: address -> (unit, units)
        self._host: dict[tuple, list[torch.Tensor]] = {}  # idle host buffers pinned outside the arena, by (shape, dtype)
        self.n_host_pinned = 0  # host buffers pinned outside the arena (when it had no room)

    @classmethod
    def of_bytes(cls, budget_bytes: float, head_dim: int, dtype: torch.dtype, device, block: int = 64,
                 host_bytes: int = 0) -> "KVPool":
        """The pool that `budget_bytes` of K and V rows buy (and a host arena of `host_bytes`)."""
        row = 2 * head_dim * torch.finfo(dtype).bits // 8
        return cls(int(budget_bytes // row), head_dim, dtype, device, block, host_bytes)

    @property
    def used_blocks(self) -> int:
        return self._blocks.used

    @property
    def peak_blocks(self) -> int:
        return self._blocks.peak

    @property
    def row_bytes(self) -> int:
        return 2 * self.head_dim * self.k.element_size()

    @property
    def capacity_bytes(self) -> int:
        return self.k.untyped_storage().nbytes() + self.v.untyped_storage().nbytes()

    @property
    def rows(self) -> int:
        return self.k.shape[0]

    def blocks_for(self, n_rows: int) -> int:
        return -(-int(n_rows) // self.block)

    def can_alloc(self, n_rows: int) -> bool:
        return self._blocks.fits(self.blocks_for(n_rows))

    @property
    def free_blocks(self) -> int:
        return self.n_blocks - self.used_blocks

    def alloc_blocks(self, n: int) -> list[Extent] | None:
        """`n` single blocks (dense pages: not contiguous with each other), lowest first, or None (nothing taken)
        where fewer than `n` are free."""
        got = self._blocks.take_singles(n)
        if got is None:
            self.n_refused += 1
            return None
        rows = self.block
        out = [Extent(j, 1, j * rows, rows) for j in got]
        self._live.update(zip(got, out))
        return out

    def alloc(self, n_rows: int) -> Extent | None:
        """One contiguous extent of at least `n_rows` rows (first fit), or None where none is free."""
        need = max(self.blocks_for(n_rows), 1)
        b = self._blocks.take(need)
        if b is None:
            self.n_refused += 1
            return None
        ext = self._live[b] = Extent(b, need, b * self.block, int(n_rows))
        return ext

    def free(self, ext: Extent) -> None:
        self.free_many([ext])

    def free_many(self, extents) -> None:
        """Give back extents handed out (all checked before any is freed)."""
        live = self._live
        if any(live.get(ext.block) is not ext for ext in extents) or len({e.block for e in extents}) < len(extents):
            raise RuntimeError("KVPool.free: the extent is not one handed out (freed twice?)")
        for ext in extents:
            del live[ext.block]
        if len(extents) == 1:
            self._blocks.give(extents[0].block, extents[0].n_blocks)
        else:
            self._blocks.give_many([e.block for e in extents], [e.n_blocks for e in extents])

    def views(self, ext: Extent) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The extent's K rows, V rows and slot positions (views into the pool)."""
        s = slice(ext.start, ext.start + ext.n_rows)
        return self.k[s], self.v[s], self.pos[s]

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer of `shape` (pinned where the pool is on CUDA, contents undefined): a view of the host arena
        where it has room, else one pinned outside it that a leaving stream gave back with this shape and dtype, else
        a new one pinned now."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        need = max(-(-nbytes // HOST_UNIT), 1)
        u = self._arena.take(need)
        if u is not None:
            buf = self.host_arena[u * HOST_UNIT: u * HOST_UNIT + nbytes].view(dtype).view(shape)
            self._arena_live[buf.data_ptr()] = (u, need)
            return buf
        idle = self._host.get((tuple(shape), dtype))
        if idle:
            return idle.pop()
        self.n_host_pinned += 1
        return torch.empty(shape, dtype=dtype, pin_memory=self.device.type == "cuda")

    def give_host(self, buf: torch.Tensor) -> None:
        """Take back `buf` (from `host_buffer`; nothing may read or write it any more): into the arena where it came
        from there, else kept for the next stream of its shape."""
        if self._arena.n and buf.untyped_storage().data_ptr() == self.host_arena.untyped_storage().data_ptr():
            got = self._arena_live.pop(buf.data_ptr(), None)
            if got is None:
                raise RuntimeError("KVPool.give_host: the buffer is not one handed out (given back twice?)")
            self._arena.give(*got)
            return
        self._host.setdefault((tuple(buf.shape), buf.dtype), []).append(buf)

    def stats(self) -> dict:
        rb = self.block * self.row_bytes
        return dict(capacity_bytes=self.capacity_bytes, used_bytes=self.used_blocks * rb,
                    peak_bytes=self.peak_blocks * rb, block_rows=self.block, n_refused=self.n_refused,
                    host_arena_bytes=self.host_arena.numel(), host_arena_used_bytes=self._arena.used * HOST_UNIT,
                    host_arena_peak_bytes=self._arena.peak * HOST_UNIT, host_pinned_outside=self.n_host_pinned)
