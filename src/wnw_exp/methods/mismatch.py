"""`analysis=mismatch`: the prefill/decode attention mismatch of §2.1 (Figure 1), recorded during a run.

`MismatchRecorder` wraps the run's policy. Every hook goes to the wrapped policy unchanged, so the method
decodes exactly as it would alone; the recorder additionally asks the engine for the softmax weights of
*every* query head at audio positions at each decode step (the engine computes them only for heads some
policy asks for) and keeps

- the first decode step's weights: the query is the first answer token, so this is the paper's
  "prefill attention from the first answer token" — the signal prefill-only methods rank positions by;
- the sum over all decode steps, divided by their number: the "decode-cumulative" distribution,
  averaged over all answer tokens.

Both are averaged over layers and query heads into one vector per audio position, and kept per KV head
(the mean over its GQA group) for the per-head Jaccard. Statistics (`sample_statistics`) use the pure
functions of `wnw_exp.metrics.mismatch`; the report averages them over samples.

The weights are those the decode step really used: run the analysis with `method=full` for §2.1 (under a
compressing method, positions that are not on the device have weight 0). A layer whose audio length
differs from the prompt's (AffPool merges tokens) cannot be averaged position by position and is left
out; the trace says which layers were used.

The recorder is a method wrapper, not a method: it defines only the hooks it records in, and every other
attribute (class attributes such as `packed_store` and `recall_headroom`, the method's own state, hooks it does
not record) is the wrapped method's. Its recording keeps host state per step, so it is not graph-safe.
"""

from __future__ import annotations

import numpy as np
import torch

from wnw_exp.kv.base import KVStore
from wnw_exp.methods.base import Policy, SampleContext
from wnw_exp.metrics.mismatch import (expected_random_jaccard, mass_fractions, random_jaccard_baseline,
                                      topk_jaccard)

JACCARD_KS = (100, 500)  # §2.1
PER_HEAD_K = 100


class MismatchRecorder:
    """Records prefill (first answer token) and decode-cumulative attention per audio position, around `inner`."""

    graph_safe = False  # per-step host state (the first step's weights, the step count)

    def __init__(self, inner: Policy, ks: tuple[int, ...] = JACCARD_KS, per_head_k: int = PER_HEAD_K):
        self.inner, self.ks, self.per_head_k = inner, tuple(ks), per_head_k

    def __getattr__(self, attr):  # every attribute the recorder does not define is the wrapped method's
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def fork(self) -> "MismatchRecorder":
        """A recorder of its own around a fork of the wrapped policy (a batch: one per sample)."""
        return MismatchRecorder(self.inner.fork(), self.ks, self.per_head_k)

    # --- the hooks it records in: the wrapped policy first, then the recording ---------------------
    def start(self, ctx: SampleContext, store: KVStore) -> None:
        self.inner.start(ctx, store)
        self.ctx, self.store = ctx, store
        self._inner_heads: dict[int, list[int]] = {}
        self._first: dict[int, torch.Tensor] = {}  # layer -> (H_q, n_audio) weights at step 0
        self._sum: dict[int, torch.Tensor] = {}  # layer -> (H_q, n_audio) summed over steps
        self._n_steps = 0

    def observe_heads(self, layer: int) -> list[int]:
        self._inner_heads[layer] = list(self.inner.observe_heads(layer))
        return list(range(self.ctx.n_q_heads))

    def observe_sum(self, layer: int) -> None:
        return None  # the recorder reads every head's weights (`observe`), never only their sum

    def observe(self, layer: int, probs: torch.Tensor) -> None:
        wanted = self._inner_heads.get(layer, [])
        if wanted:  # the rows the wrapped policy asked for, in its order
            self.inner.observe(layer, probs[torch.tensor(wanted, device=probs.device)])
        p = probs.detach().double()
        if self._n_steps == 0:
            self._first[layer] = p.clone()
        if layer in self._sum:
            self._sum[layer] += p
        else:
            self._sum[layer] = p.clone()

    def after_step(self, step: int) -> None:
        self.inner.after_step(step)
        self._n_steps += 1

    # --- the record --------------------------------------------------------------------------------
    def trace(self, read=None) -> dict:
        return {**self.inner.trace(), "mismatch": self.record()}

    def record(self) -> dict:
        """Per-position vectors (lists) and this sample's statistics; JSON-serialisable."""
        n_audio = self.ctx.n_audio
        layers = sorted(li for li, p in self._first.items() if p.shape[-1] == n_audio)
        out = dict(n_steps=self._n_steps, n_audio=n_audio, layers_used=layers, n_layers=self.ctx.n_layers)
        if self._n_steps == 0 or not layers:
            return dict(out, prefill=None, decode_cumulative=None, per_head_jaccard=None, stats=None)
        first = torch.stack([self._first[li] for li in layers])  # (L', H_q, T)
        cum = torch.stack([self._sum[li] for li in layers]) / self._n_steps
        g = self.ctx.group
        # per KV head: the mean over its GQA group of query heads, layer-major (L', H_kv, T)
        first_kv = first.view(len(layers), -1, g, n_audio).mean(dim=2).reshape(-1, n_audio).cpu().numpy()
        cum_kv = cum.view(len(layers), -1, g, n_audio).mean(dim=2).reshape(-1, n_audio).cpu().numpy()
        prefill = first.mean(dim=(0, 1)).cpu().numpy()
        decode = cum.mean(dim=(0, 1)).cpu().numpy()
        per_head = [topk_jaccard(a, b, self.per_head_k) for a, b in zip(first_kv, cum_kv)]
        try:
            stats = sample_statistics(prefill, decode, self.ks)
        except ValueError:  # a vector without mass (every audio weight 0): no statistics for this sample
            stats = None
        return dict(out, prefill=prefill.tolist(), decode_cumulative=decode.tolist(),
                    per_head_jaccard=per_head, per_head_k=self.per_head_k, stats=stats)


def sample_statistics(prefill: np.ndarray, decode: np.ndarray, ks: tuple[int, ...] = JACCARD_KS) -> dict:
    """§2.1's numbers for one sample: mass on the first 10% / each half, top-K Jaccard with baselines."""
    T = int(np.asarray(prefill).size)
    return dict(
        prefill=mass_fractions(prefill),
        decode=mass_fractions(decode),
        jaccard={str(k): topk_jaccard(prefill, decode, k) for k in ks},
        k_effective={str(k): min(k, T) for k in ks},
        random_baseline={str(k): random_jaccard_baseline(k, T) for k in ks},
        expected_random_jaccard={str(k): expected_random_jaccard(k, T) for k in ks},
    )
