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

Host memory: the pinned host mirrors of the streams whose method keeps a CPU tier (`host_buffer`) are kept by the
pool when a stream leaves and handed to the next stream of the same shape, as a server keeps its swap space: pinning
hundreds of MB for each request costs more than its prefill (`cudaHostAlloc` maps and locks every page).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Extent:
    block: int  # first block
    n_blocks: int
    start: int  # first row (block * rows per block)
    n_rows: int  # rows asked for (<= n_blocks * rows per block)


class PoolFull(RuntimeError):
    """A request's KV does not fit the pool's free blocks."""


class KVPool:
    def __init__(self, n_rows: int, head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 block: int = 64):
        if n_rows < block or block < 1:
            raise ValueError(f"a KV pool needs at least one block of {block} rows (asked for {n_rows} rows)")
        self.block, self.head_dim, self.dtype, self.device = block, head_dim, dtype, torch.device(device)
        self.n_blocks = n_rows // block
        self.k = torch.empty(self.n_blocks * block, head_dim, device=self.device, dtype=dtype)
        self.v = torch.empty_like(self.k)
        self.pos = torch.full((self.n_blocks * block,), -1, device=self.device, dtype=torch.int32)  # audio slots' positions
        self._free: list[tuple[int, int]] = [(0, self.n_blocks)]  # (first block, length), sorted, never adjacent
        self._live: dict[int, Extent] = {}  # extents handed out, by first block
        self.used_blocks = self.peak_blocks = 0
        self.n_refused = 0
        self._host: dict[tuple, list[torch.Tensor]] = {}  # idle pinned host buffers, by (shape, dtype)

    @classmethod
    def of_bytes(cls, budget_bytes: float, head_dim: int, dtype: torch.dtype, device, block: int = 64) -> "KVPool":
        """The pool that `budget_bytes` of K and V rows buy."""
        row = 2 * head_dim * torch.finfo(dtype).bits // 8
        return cls(int(budget_bytes // row), head_dim, dtype, device, block)

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
        need = self.blocks_for(n_rows)
        return any(n >= need for _, n in self._free)

    @property
    def free_blocks(self) -> int:
        return self.n_blocks - self.used_blocks

    def alloc_blocks(self, n: int) -> list[Extent] | None:
        """`n` single blocks (dense pages: not contiguous with each other), lowest first, or None (nothing taken)
        where fewer than `n` are free."""
        if n > self.free_blocks:
            self.n_refused += 1
            return None
        out: list[Extent] = []
        while len(out) < n:
            b, m = self._free[0]
            take = min(m, n - len(out))
            if take == m:
                del self._free[0]
            else:
                self._free[0] = (b + take, m - take)
            for j in range(b, b + take):
                ext = self._live[j] = Extent(j, 1, j * self.block, self.block)
                out.append(ext)
        self.used_blocks += n
        self.peak_blocks = max(self.peak_blocks, self.used_blocks)
        return out

    def alloc(self, n_rows: int) -> Extent | None:
        """One contiguous extent of at least `n_rows` rows (first fit), or None where none is free."""
        need = max(self.blocks_for(n_rows), 1)
        for i, (b, n) in enumerate(self._free):
            if n >= need:
                if n == need:
                    del self._free[i]
                else:
                    self._free[i] = (b + need, n - need)
                self.used_blocks += need
                self.peak_blocks = max(self.peak_blocks, self.used_blocks)
                ext = self._live[b] = Extent(b, need, b * self.block, int(n_rows))
                return ext
        self.n_refused += 1
        return None

    def free(self, ext: Extent) -> None:
        if self._live.get(ext.block) != ext:
            raise RuntimeError("KVPool.free: the extent is not one handed out (freed twice?)")
        del self._live[ext.block]
        i = bisect.bisect_left(self._free, (ext.block, 0))
        b, n = ext.block, ext.n_blocks
        if i < len(self._free) and b + n == self._free[i][0]:  # merge with the next free run
            n += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == b:  # and with the previous one
            b, n = self._free[i - 1][0], self._free[i - 1][1] + n
            self._free[i - 1] = (b, n)
        else:
            self._free.insert(i, (b, n))
        self.used_blocks -= ext.n_blocks

    def views(self, ext: Extent) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The extent's K rows, V rows and slot positions (views into the pool)."""
        s = slice(ext.start, ext.start + ext.n_rows)
        return self.k[s], self.v[s], self.pos[s]

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer of `shape` (pinned where the pool is on CUDA, contents undefined): one a leaving stream gave
        back (`give_host`), else a new one."""
        idle = self._host.get((tuple(shape), dtype))
        if idle:
            return idle.pop()
        return torch.empty(shape, dtype=dtype, pin_memory=self.device.type == "cuda")

    def give_host(self, buf: torch.Tensor) -> None:
        """Keep `buf` (from `host_buffer`; nothing may read or write it any more) for the next stream of its shape."""
        self._host.setdefault((tuple(buf.shape), buf.dtype), []).append(buf)

    def stats(self) -> dict:
        rb = self.block * self.row_bytes
        return dict(capacity_bytes=self.capacity_bytes, used_bytes=self.used_blocks * rb,
                    peak_bytes=self.peak_blocks * rb, block_rows=self.block, n_refused=self.n_refused)
