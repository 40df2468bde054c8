"""A per-step trace of WnW's placement against the full-cache attention: where does the resident set miss?

`PlacementTrace` wraps a WnW policy the way `mismatch.MismatchRecorder` wraps any method: every hook goes to the
wrapped policy unchanged, so WnW decodes exactly as it would alone (its own tokens, its own queries), and the trace
adds, at every decode step and layer, what the full cache would have attended to with that same query:

- the true attention (`oracle.true_audio_attention`): the step's softmax weights at *every* audio key of the layer,
  normalised with the non-audio keys (the new token's own included, as the full cache's attention has it) and
  summed over each KV head's GQA group, from a copy of the prompt's audio keys taken at prefill. This is the
  attention of the full cache for WnW's own query and its own text so far;
- `mass_kept[step, layer, head]`: the share of that head's true audio mass lying on the positions resident on the
  device for this step's attention (anchors keep everything: 1);
- `audio_share[step, layer, head]`: the head's true audio mass itself (the mean over its group of the attention
  share that goes to audio at all), which says which misses matter;
- `segment_mass[step, segment]`: the true audio mass summed over the tidal heads (the heads the chunk swap
  serves) per segment, and `segment_lost[step, segment]` the part of it on positions not resident;
- `true_segment[step]`: the segment holding the most of `segment_mass`, and `tidal_segment[step, i]` the same per
  tidal head;
- `anchor_chunk[step]`: the chunk with the highest mean of the anchors' summed attention at this step (the
  signal the swap ranks chunks by, Eq. 2), with `selected_chunks` the swap's top-k (in force at the next step);
- `recalled[step]`: the segments recalled for this step's attention, and `hit[step]`: `true_segment` is one of
  them (or its positions were all kept at prefill, which a segment never is at r < 1).

It runs on the reference store (the CPU path): the resident positions are read from the store's per-head tiers.
Its recording keeps host state per step, so it is not graph-safe.
"""

from __future__ import annotations

import numpy as np
import torch

from wnw_exp.kv.base import KVStore
from wnw_exp.methods.base import PrefillScores, SampleContext
from wnw_exp.methods.oracle import true_audio_attention
from wnw_exp.methods.wnw import WnW, triage


class PlacementTrace:
    """Records WnW's resident set against the full-cache attention at every decode step, around `inner` (a WnW)."""

    graph_safe = False
    packed_store = False  # the resident positions are read from the reference store's tiers

    def __init__(self, inner: WnW):
        if not isinstance(inner, WnW):
            raise ValueError(f"PlacementTrace traces WnW's chunk swap; got method {getattr(inner, 'name', inner)!r}")
        self.inner = inner

    def __getattr__(self, attr):  # every attribute the trace does not define is the wrapped method's
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def fork(self) -> "PlacementTrace":
        return PlacementTrace(self.inner.fork())

    # --- hooks ------------------------------------------------------------------------------------------
    def start(self, ctx: SampleContext, store: KVStore) -> None:
        if store.queues_moves:
            raise ValueError("PlacementTrace reads the reference store's tiers: decode with store='reference'")
        self.inner.start(ctx, store)
        self.ctx, self.store = ctx, store
        self.keys: dict[int, torch.Tensor] = {}
        self.scale = ctx.head_dim ** -0.5
        self._tidal_mask = self.inner.roles == triage.TIDAL  # (L, H_kv)
        self._step: dict | None = None
        self._q: torch.Tensor | None = None  # the current layer's query, from `before_attention`
        self._inner_heads: dict[int, list[int]] = {}
        self.steps: list[dict] = []

    def place(self, layer: int, scores: PrefillScores):
        if scores.audio_keys.shape[1] != self.ctx.n_audio:
            raise ValueError("PlacementTrace needs every prompt audio key (a merging method changes them)")
        self.keys[layer] = scores.audio_keys.detach().clone()
        return self.inner.place(layer, scores)

    def observe_heads(self, layer: int) -> list[int]:
        # The wrapped method's heads, or one head where it watches none: either way the engine calls `observe`
        # after every layer's attention, when the new token's key is in the store (the full cache normalises over it)
        self._inner_heads[layer] = list(self.inner.observe_heads(layer))
        return self._inner_heads[layer] or [0]

    def before_attention(self, layer: int, q: torch.Tensor) -> None:
        self.inner.before_attention(layer, q)
        if self._step is None:
            self._begin_step()
        self._q = q.detach()

    def observe(self, layer: int, probs: torch.Tensor) -> None:
        if self._inner_heads.get(layer):  # exactly the rows the wrapped method asked for, in its order
            self.inner.observe(layer, probs)
        true = true_audio_attention(self._q, self.keys[layer], self.store.dense_keys(layer), self.scale)
        true = true.double().cpu()
        H, g = self.ctx.n_kv_heads, self.ctx.group
        s = self._step
        for h in range(H):
            resident = self.store.heads[layer][h].gpu_pos.cpu()
            total = float(true[h].sum())
            s["audio_share"][layer, h] = total / g
            s["mass_kept"][layer, h] = float(true[h, resident].sum()) / total if total > 0 else 1.0
            if self._tidal_mask[layer, h]:
                s["tidal_attention"].append(true[h])
                lost = true[h].clone()
                lost[resident] = 0
                s["tidal_lost"] += lost.numpy()

    def _begin_step(self) -> None:
        L, H = self.ctx.n_layers, self.ctx.n_kv_heads
        self._step = dict(mass_kept=np.ones((L, H)), audio_share=np.zeros((L, H)), tidal_attention=[],
                          tidal_lost=np.zeros(self.ctx.n_audio),
                          recalled=np.flatnonzero(self.inner.swap.recalled).tolist())

    def after_step(self, step: int | None) -> None:
        anchor = self.inner.scores_acc.detach().double().cpu().numpy().copy()  # this step's A, before the swap resets it
        self.inner.after_step(step)
        if self._step is None:  # no attention ran (nothing to record)
            return
        s, self._step = self._step, None
        swap, n_s = self.inner.swap, self.inner.n_s
        n_seg = len(swap.segments)
        record = dict(mass_kept=s["mass_kept"].astype(np.float32), audio_share=s["audio_share"].astype(np.float32),
                      recalled=s["recalled"])
        tidal = torch.stack(s["tidal_attention"]).numpy() if s["tidal_attention"] else np.zeros((0, self.ctx.n_audio))
        seg_of = np.arange(self.ctx.n_audio) // n_s
        per_seg = np.zeros((len(tidal), n_seg))
        for i, row in enumerate(tidal):
            per_seg[i] = np.bincount(seg_of, weights=row, minlength=n_seg)
        record["segment_mass"] = per_seg.sum(axis=0).astype(np.float32)
        record["segment_lost"] = np.bincount(seg_of, weights=s["tidal_lost"], minlength=n_seg).astype(np.float32)
        record["tidal_segment"] = per_seg.argmax(axis=1).tolist() if len(per_seg) else []
        record["true_segment"] = int(per_seg.sum(axis=0).argmax()) if len(per_seg) else -1
        record["hit"] = record["true_segment"] in set(s["recalled"])
        record["anchor_chunk"] = _argmax_chunk(anchor, swap.chunks)
        trace = self.inner._trace
        record["selected_chunks"] = trace["selected_chunks"][-1] if trace["selected_chunks"] else []
        self.steps.append(record)

    # --- the record ---------------------------------------------------------------------------------------
    def trace(self, read=None) -> dict:
        return {**self.inner.trace(), "placement": self.record()}

    def record(self) -> dict:
        """JSON-serialisable: the swap's geometry, the tidal heads, and the per-step arrays (steps first)."""
        swap = self.inner.swap
        tidal = [[int(li), int(k)] for li, k in zip(*np.nonzero(self._tidal_mask))]
        out = dict(n_audio=self.ctx.n_audio, token_rate=self.ctx.token_rate, n_s=self.inner.n_s,
                   n_c=self.inner.n_c, segments=[list(b) for b in swap.segments],
                   chunks=[list(c) for c in swap.chunks], tidal_heads=tidal, n_steps=len(self.steps))
        for key in ("true_segment", "anchor_chunk", "hit", "recalled", "selected_chunks", "tidal_segment"):
            out[key] = [s[key] for s in self.steps]
        for key in ("mass_kept", "audio_share", "segment_mass", "segment_lost"):
            out[key] = np.stack([s[key] for s in self.steps]).round(5).tolist() if self.steps else []
        return out


def _argmax_chunk(a: np.ndarray, chunks: list[tuple[int, int]]) -> int:
    """The chunk with the highest mean of `a` over its positions (ties: the earlier), as the swap ranks them."""
    if not chunks:
        return -1
    c = np.concatenate([[0.0], np.cumsum(a, dtype=np.float64)])
    starts = np.array([s for s, _ in chunks])
    ends = np.array([e for _, e in chunks])
    return int(np.argmax((c[ends] - c[starts]) / (ends - starts)))
