"""The reference KV-tier store (`kv.base.KVStore`): per layer a dense part for non-audio tokens and, per KV head,
audio positions in three tiers — GPU-resident (physically packed), CPU-resident (recallable) and dropped.

This file is the specification: plain tensors, one loop over KV heads, moves that act at once (a head's recalled
positions are appended in the order given, so the order of its keys is the caller's). Keys are stored after
RoPE, so a position's key never changes when it moves between tiers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from wnw_exp.kv.base import KVStore, StepAccounting, StepRecord, TiersPerHead, flat_pairs


@dataclass
class HeadTiers:
    """Audio KV of one (layer, KV head). `gpu_*` live on the compute device, `cpu_*` on the host."""

    gpu_pos: torch.Tensor  # (n_gpu,) long, audio indices in [0, n_audio)
    gpu_k: torch.Tensor  # (n_gpu, D)
    gpu_v: torch.Tensor
    cpu_pos: torch.Tensor  # (n_cpu,) long, on host; sorted
    cpu_k: torch.Tensor  # (n_cpu, D), on host (pinned when the device is CUDA)
    cpu_v: torch.Tensor


@dataclass
class AudioKVStore(TiersPerHead, StepAccounting, KVStore):
    n_layers: int
    n_kv_heads: int
    head_dim: int
    n_audio: int  # audio tokens of the prompt, before any merging: N_audio of §3.4
    device: torch.device
    dtype: torch.dtype
    dense_capacity: int
    dense_k: list[torch.Tensor] = field(default_factory=list)  # per layer (H_kv, capacity, D)
    dense_v: list[torch.Tensor] = field(default_factory=list)
    dense_len: list[int] = field(default_factory=list)
    heads: list[list[HeadTiers]] = field(default_factory=list)  # [layer][kv head]
    layer_audio: list[int] = field(default_factory=list)  # audio tokens of a layer (< n_audio after merging)
    steps: list[StepRecord] = field(default_factory=list)
    _h2d_this_step: int = 0
    queues_moves = False  # recall and release act at once

    # --- writing ------------------------------------------------------------------------------
    def write_prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor, audio_span: tuple[int, int]) -> None:
        """k, v: (H_kv, T, D) for the prompt after RoPE. Every audio position starts GPU-resident."""
        assert layer == len(self.dense_k), "layers are written in order"
        s, e = audio_span
        dense_k = torch.cat([k[:, :s], k[:, e:]], dim=1)
        dense_v = torch.cat([v[:, :s], v[:, e:]], dim=1)
        n = dense_k.shape[1]
        bk = torch.empty(self.n_kv_heads, n + self.dense_capacity, self.head_dim, device=self.device, dtype=self.dtype)
        bv = torch.empty_like(bk)
        bk[:, :n], bv[:, :n] = dense_k, dense_v
        self.dense_k.append(bk)
        self.dense_v.append(bv)
        self.dense_len.append(n)
        n_a = e - s
        empty = torch.empty(0, self.head_dim, dtype=self.dtype)
        pos = torch.arange(n_a, device=self.device)
        self.heads.append([
            HeadTiers(pos.clone(), k[h, s:e].clone(), v[h, s:e].clone(),  # own storage, not a view
                      torch.empty(0, dtype=torch.long), empty, empty)
            for h in range(self.n_kv_heads)
        ])
        self.layer_audio.append(n_a)

    def set_tiers(self, layer: int, head: int, gpu: torch.Tensor, cpu: torch.Tensor | None = None) -> None:
        """After prefill: keep audio positions `gpu` on the device, copy `cpu` to the host, drop the rest.

        Both index the head's current GPU tier by audio position. A position in both stays resident and
        also gets a host copy (a mirror, as ArkVale keeps), so it can later be released and recalled.
        """
        t = self.heads[layer][head]
        index = torch.full((self.layer_audio[layer],), -1, dtype=torch.long, device=self.device)
        index[t.gpu_pos] = torch.arange(len(t.gpu_pos), device=self.device)
        gpu = torch.sort(gpu.to(self.device).long()).values
        rows = index[gpu]
        if (rows < 0).any():
            raise ValueError("set_tiers: a position to keep is not GPU-resident")
        if cpu is not None and len(cpu):
            cpu = torch.sort(cpu.to(self.device).long()).values
            crows = index[cpu]
            if (crows < 0).any():
                raise ValueError("set_tiers: a position to offload is not GPU-resident")
            t.cpu_pos, t.cpu_k, t.cpu_v = self._to_host(cpu), self._to_host(t.gpu_k[crows]), self._to_host(t.gpu_v[crows])
        # Index-select makes new, exactly-sized tensors: the old GPU storage is freed, not masked.
        t.gpu_pos, t.gpu_k, t.gpu_v = gpu, t.gpu_k[rows].contiguous(), t.gpu_v[rows].contiguous()

    def _to_host(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to("cpu", copy=True)
        return x.pin_memory() if self.device.type == "cuda" else x

    def compact(self, headroom: int | np.ndarray = 0) -> None:
        """Nothing to do: `set_tiers` already keeps exactly-sized tensors, and a recall grows a head's own."""

    # --- moving between tiers -----------------------------------------------------------------
    def recall(self, rows, positions, select=None) -> int:
        """Copy host-resident positions back to the device (the host copy stays). Returns how many moved.

        Positions already on the device are skipped; a position with no host copy is an error. Each head's
        positions are appended in the order given."""
        return self._per_head(self._recall_head, rows, positions, select)

    def release(self, rows, positions, select=None) -> int:
        """Free device copies of positions that have a host copy. Returns how many were released."""
        return self._per_head(self._release_head, rows, positions, select)

    def flush(self, layer: int | None = None) -> None:
        """Nothing is ever queued."""

    def check(self) -> None:
        """Every move raised at once if it could not be made."""

    def _per_head(self, fn, rows, positions, select) -> int:
        rows, pos = flat_pairs(rows, positions, select)
        order = np.argsort(rows, kind="stable")  # by head, each head's positions in the order given
        rows, pos = rows[order], pos[order]
        n = 0
        for r, start in zip(*np.unique(rows, return_index=True)):
            end = np.searchsorted(rows, r, side="right")
            n += fn(int(r) // self.n_kv_heads, int(r) % self.n_kv_heads, torch.from_numpy(pos[start:end].copy()))
        return n

    def _recall_head(self, layer: int, head: int, positions: torch.Tensor) -> int:
        t = self.heads[layer][head]
        positions = positions.to("cpu").long()
        on_gpu = torch.isin(positions, t.gpu_pos.cpu())
        positions = positions[~on_gpu]
        if len(positions) == 0:
            return 0
        rows = torch.searchsorted(t.cpu_pos, positions)
        rows_ok = (rows < len(t.cpu_pos)) & (t.cpu_pos[rows.clamp(max=max(len(t.cpu_pos) - 1, 0))] == positions) \
            if len(t.cpu_pos) else torch.zeros_like(positions, dtype=torch.bool)
        if not bool(rows_ok.all()):
            raise ValueError(f"recall: positions {positions[~rows_ok].tolist()[:5]} of layer {layer} head {head} "
                             "have no host copy (they were dropped)")
        k = t.cpu_k[rows].to(self.device, non_blocking=True)
        v = t.cpu_v[rows].to(self.device, non_blocking=True)
        self._h2d_this_step += k.numel() * k.element_size() * 2
        t.gpu_pos = torch.cat([t.gpu_pos, positions.to(self.device)])
        t.gpu_k = torch.cat([t.gpu_k, k])
        t.gpu_v = torch.cat([t.gpu_v, v])
        return len(positions)

    def _release_head(self, layer: int, head: int, positions: torch.Tensor) -> int:
        t = self.heads[layer][head]
        positions = positions.to(self.device).long()
        if not bool(torch.isin(positions, t.cpu_pos.to(self.device)).all()):
            raise ValueError("release: a position without a host copy would be lost; drop it explicitly instead")
        keep = ~torch.isin(t.gpu_pos, positions)
        n = int((~keep).sum())
        if n:
            t.gpu_pos, t.gpu_k, t.gpu_v = t.gpu_pos[keep], t.gpu_k[keep].contiguous(), t.gpu_v[keep].contiguous()
        return n

    def dense_keys(self, layer: int) -> torch.Tensor:
        """(H_kv, n, D) the layer's non-audio keys so far (after RoPE)."""
        return self.dense_k[layer][:, : self.dense_len[layer]]

    # --- attention ----------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, scale: float,
               observe: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step of one layer.

        q: (H_q, D) after RoPE; k_new, v_new: (H_kv, D) of the new token, appended to the dense part first.
        Returns the attention output (H_q, D) and, if `observe` lists query heads, their softmax weights at
        audio positions as a dense (len(observe), layer_audio) tensor (zero where a position is not resident).
        The dense and the ragged audio parts are attended separately and merged by log-sum-exp.
        """
        n = self.dense_len[layer]
        if n >= self.dense_k[layer].shape[1]:
            raise RuntimeError("dense KV capacity exhausted: raise the engine's max_new_tokens capacity")
        self.dense_k[layer][:, n] = k_new
        self.dense_v[layer][:, n] = v_new
        self.dense_len[layer] = n + 1
        H, D = self.n_kv_heads, self.head_dim
        g = q.shape[0] // H
        qg = q.view(H, g, D).float()
        dk = self.dense_k[layer][:, : n + 1].float()
        dv = self.dense_v[layer][:, : n + 1].float()
        s_dense = torch.einsum("hgd,hnd->hgn", qg, dk) * scale
        lse_dense = torch.logsumexp(s_dense, dim=-1)  # (H, g)
        out_dense = torch.einsum("hgn,hnd->hgd", torch.softmax(s_dense, dim=-1), dv)
        out = torch.empty(H, g, D, device=q.device, dtype=torch.float32)
        want = set(observe or [])
        probs = {} if want else None
        for h in range(H):
            t = self.heads[layer][h]
            if len(t.gpu_pos) == 0:
                out[h] = out_dense[h]
                continue
            s_audio = (qg[h] @ t.gpu_k.float().T) * scale  # (g, n_h)
            lse_audio = torch.logsumexp(s_audio, dim=-1)
            out_audio = torch.softmax(s_audio, dim=-1) @ t.gpu_v.float()
            lse = torch.logaddexp(lse_dense[h], lse_audio)
            w_dense = torch.exp(lse_dense[h] - lse)[:, None]
            out[h] = w_dense * out_dense[h] + (1 - w_dense) * out_audio
            if want:
                for j in range(g):
                    if h * g + j in want:
                        p = torch.zeros(self.layer_audio[layer], device=q.device)
                        p[t.gpu_pos] = torch.exp(s_audio[j] - lse[j])
                        probs[h * g + j] = p
        observed = None
        if want:
            observed = torch.stack([probs.get(i, torch.zeros(self.layer_audio[layer], device=q.device))
                                    for i in observe])
        return out.view(H * g, D).to(q.dtype), observed

    # --- accounting (§3.4) --------------------------------------------------------------------
    def n_gpu(self) -> int:
        return sum(len(t.gpu_pos) for layer in self.heads for t in layer)

    def n_gpu_cpu(self) -> int:
        """Positions on the device or recallable from the host (their union)."""
        return sum(len(t.gpu_pos) + int((~torch.isin(t.cpu_pos, t.gpu_pos.cpu())).sum())
                   for layer in self.heads for t in layer)

    def audio_bytes_on_device(self) -> int:
        """Physical bytes of the device-resident audio K and V (storage sizes, not element counts)."""
        return sum(t.gpu_k.untyped_storage().nbytes() + t.gpu_v.untyped_storage().nbytes()
                   for layer in self.heads for t in layer)
