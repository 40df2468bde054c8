"""The KV-tier store protocol, and the §3.4 accounting every store shares.

A store holds, per layer, a dense part for the non-audio tokens (the prompt's text, every generated token) and,
per KV head, the audio positions in three tiers: on the device, on the host (recallable), dropped. Keys are
stored after RoPE, so a position's key never changes when it moves. Two implementations: `reference.AudioKVStore`
(the specification: plain tensors, one loop over KV heads, moves act at once) and `packed.PackedAudioKVStore`
(the GPU store: packed buffers, device-side bookkeeping, queued moves a CUDA graph can hold).

Moves address (layer, KV head) pairs by their row, `layer * n_kv_heads + head`. `recall(rows, positions)` and
`release(rows, positions)` are the only two move calls: `rows` is one row or one row per position, `positions`
the audio positions, and `select` (optional, bool, one per pair) says which of the pairs to move, so that a
device-side policy can hand over fixed-shape tensors (no host read). Resident positions are skipped by recall,
non-resident ones by release; a position without a host copy cannot be moved (it would be lost).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


def to_device(x, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host array (or list) on `device` with no host wait: on CUDA copied from pinned memory, asynchronously (a
    plain copy from pageable memory waits for the stream's queued work: a decode step in flight, a prefill)."""
    t = torch.as_tensor(np.ascontiguousarray(x) if isinstance(x, np.ndarray) else x, dtype=dtype)
    if device.type == "cuda" and t.numel():
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class HostRead:
    """Several device tensors of integers or booleans read to the host in one copy (each read of its own would wait
    for the device), each in its own shape and dtype. On CUDA the copy is queued on the current stream, after the
    work queued there so far, into pinned memory, and the host waits for it only in `get()`: a read started before
    the next step is launched does not wait for that step."""

    def __init__(self, *tensors: torch.Tensor):
        assert not any(t.is_floating_point() for t in tensors), "HostRead carries integers and booleans (through int64)"
        self.shapes = [(t.shape, t.dtype, t.numel()) for t in tensors]
        flat = torch.cat([t.reshape(-1).long() for t in tensors])
        self.done = None
        if flat.is_cuda:
            self.flat = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self.flat.copy_(flat, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.flat = flat

    def get(self) -> list[torch.Tensor]:
        if self.done is not None:
            self.done.synchronize()
            self.done = None
        out, at = [], 0
        for shape, dtype, n in self.shapes:
            out.append(self.flat[at: at + n].view(shape).to(dtype))
            at += n
        return out


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """`HostRead(*tensors).get()`: the tensors on the host, now."""
    return HostRead(*tensors).get()


def upload(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` from a host tensor with no host wait, as `to_device` (a launch table rewritten in place)."""
    if dst.is_cuda:
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


@dataclass
class StepRecord:
    n_gpu: int  # audio KV tokens on the device, all layers and heads
    n_gpu_cpu: int  # audio KV tokens on the device or recallable from the host (union)
    h2d_bytes: int  # bytes copied host -> device during the step


class KVStore(Protocol):
    """What the engine and the methods call. Layers are written in order at prefill, then decoded step by step.
    The stores subclass it, so that every store answers `pool` and `kernels`."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    n_audio: int  # audio tokens of the prompt, before any merging: N_audio of §3.4
    device: torch.device
    layer_audio: list[int]  # audio tokens of each layer (fewer than n_audio after token merging)
    queues_moves: bool  # False: recall/release act at once, in call order; True: they are applied by `flush`
    pool = None  # the `kv.pool.KVPool` its device rows live in, shared with a batch's other streams (None: its own)
    kernels = "torch"  # its attention and moves: "torch" (PyTorch, the specification) or "triton"

    def write_prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor, audio_span: tuple[int, int]) -> None:
        """k, v (H_kv, T, D) of the prompt after RoPE; every audio position starts on the device."""

    def set_tiers(self, layer: int, head: int, gpu: torch.Tensor, cpu: torch.Tensor | None = None) -> None:
        """After prefill: keep `gpu` on the device, give `cpu` a host copy, drop the rest (overlap = a mirror)."""

    def set_tiers_block(self, row0: int, gpu: torch.Tensor, cpu: torch.Tensor | None = None,
                        select: torch.Tensor | None = None) -> None:
        """`set_tiers` of the consecutive rows row0 .. row0 + m - 1 at once: `gpu` and `cpu` (m, n_audio) bool masks
        (`cpu` may be None), `select` (m,) bool (None: every row) the rows to set."""

    def defer_checks(self) -> None:
        """Let the placement's residency checks be read at the next `compact` rather than at each call (a store
        that reads nothing from the device per call ignores it)."""

    def compact(self, headroom: int | np.ndarray = 0) -> None:
        """After every layer's `set_tiers`: free what was dropped, keeping `headroom` rows per head for recalls."""

    def recall(self, rows, positions, select: torch.Tensor | None = None) -> int | None:
        """Copy host-tier positions back to the device (the host copy stays). Returns how many (None in a graph)."""

    def release(self, rows, positions, select: torch.Tensor | None = None) -> int | None:
        """Free the device copies of positions that have a host copy. Returns how many (None in a graph)."""

    def queue_pages(self, layer: int, page_of: torch.Tensor, codes: torch.Tensor) -> None:
        """A method's per-head page decision, as data: on KV head h of `layer`, every position p whose page
        page_of[p] has codes[h, page] == 2 is released and == 1 recalled (as `release` and `recall` do, in that
        order). codes (H_kv, >= n_pages) int8, page_of (n_audio,) int64. A store with Triton kernels does it in one
        launch."""
        H, N = codes.shape[0], page_of.shape[0]
        code = codes[:, page_of]
        rows = (layer * H + torch.arange(H, device=codes.device))[:, None].expand(H, N)
        pos = torch.arange(N, device=codes.device).expand(H, N)
        self.release(rows, pos, select=code == 2)
        self.recall(rows, pos, select=code == 1)

    def flush(self, layer: int | None = None) -> None:
        """Apply the queued moves (of one layer, or all) before the attention that must see them."""

    def check(self) -> None:
        """After decoding: raise if a move could not be made (a captured flush cannot raise when it happens)."""

    def read_records(self) -> "HostRead | None":
        """After decoding: start reading what `records` returns from the device, without waiting for it (None: a
        store that keeps them on the host)."""
        return None

    def records(self, read: "HostRead | None" = None) -> list[StepRecord]:
        """After decoding: `check`, then the decode steps' records (`read`: from `read_records`, called earlier)."""
        self.check()
        return self.steps

    def release_memory(self) -> None:
        """The stream has left (or was preempted): give back what it holds in a shared pool (nothing without one)."""

    def dense_keys(self, layer: int) -> torch.Tensor:
        """(H_kv, n, D) the layer's non-audio keys so far (after RoPE)."""

    def attend(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, scale: float,
               observe: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step of one layer: appends k_new, v_new (H_kv, D); q (H_q, D) after RoPE. Returns the
        output (H_q, D) and, for the query heads in `observe`, their softmax weights at the audio positions."""

    def end_step(self) -> StepRecord:
        """Close a decode step's accounting."""

    def summary(self, steps: list[StepRecord] | None = None) -> dict:
        """r_GPU, r_GPU+CPU (mean over decode steps and at the end), r_GPU's peak over the steps, MB/step, physical
        bytes held (`steps`: the store's `steps`, where the caller has them)."""


class TiersPerHead:
    """`set_tiers_block` as one `set_tiers` per selected row, in row order, for a store whose tiers are set one head at
    a time anyway (the reference). The masks are read on the host."""

    def set_tiers_block(self, row0: int, gpu: torch.Tensor, cpu: torch.Tensor | None = None,
                        select: torch.Tensor | None = None) -> None:
        gpu = gpu.detach().cpu().bool()
        cpu = None if cpu is None else cpu.detach().cpu().bool()
        rows = range(gpu.shape[0]) if select is None else np.flatnonzero(np.asarray(select.detach().cpu(), bool))
        for i in rows:
            r = row0 + int(i)
            self.set_tiers(r // self.n_kv_heads, r % self.n_kv_heads, gpu[i].nonzero().flatten(),
                           None if cpu is None else cpu[i].nonzero().flatten())


def flat_pairs(rows, positions, select=None) -> tuple[np.ndarray, np.ndarray]:
    """(rows, positions) as flat int64 host arrays of equal length, `rows` broadcast, only the `select`ed pairs."""
    pos = np.asarray(positions.detach().cpu() if torch.is_tensor(positions) else positions, np.int64).ravel()
    r = np.asarray(rows.detach().cpu() if torch.is_tensor(rows) else rows, np.int64).ravel()
    r = np.broadcast_to(r, pos.shape) if r.size == 1 else r
    if select is not None:
        keep = np.asarray(select.detach().cpu() if torch.is_tensor(select) else select, bool).ravel()
        r, pos = r[keep], pos[keep]
    return r, pos


class StepAccounting:
    """§3.4 accounting shared by every store: one StepRecord per decode step, and the run's summary.

    A store provides `n_full`, `n_gpu()`, `n_gpu_cpu()`, `audio_bytes_on_device()`, a `steps` list
    and the `_h2d_this_step` byte counter its recalls add to.
    """

    def end_step(self) -> StepRecord:
        rec = StepRecord(self.n_gpu(), self.n_gpu_cpu(), self._h2d_this_step)
        self.steps.append(rec)
        self._h2d_this_step = 0
        return rec

    @property
    def n_full(self) -> int:
        """N_full^audio = L * H_kv * N_audio."""
        return self.n_layers * self.n_kv_heads * self.n_audio

    def summary(self, steps: list[StepRecord] | None = None) -> dict:
        """r_GPU and r_GPU+CPU as the mean over decode steps and at the end, r_GPU's peak over the steps (what a
        pool sized by the retention must hold: the methods promise it stays at or under the target), MB/step, bytes
        held. `steps`: the store's `steps` where the caller has read them already (a packed store's is a host read)."""
        full = max(self.n_full, 1)
        steps = (self.steps if steps is None else steps) or [StepRecord(self.n_gpu(), self.n_gpu_cpu(), 0)]
        return dict(
            r_gpu=sum(s.n_gpu for s in steps) / len(steps) / full,
            r_gpu_max=max(s.n_gpu for s in steps) / full,
            r_gpu_cpu=sum(s.n_gpu_cpu for s in steps) / len(steps) / full,
            r_gpu_end=steps[-1].n_gpu / full,
            r_gpu_cpu_end=steps[-1].n_gpu_cpu / full,
            mb_per_step=sum(s.h2d_bytes for s in steps) / len(steps) / 1e6,
            audio_bytes_on_device=self.audio_bytes_on_device(),
        )
