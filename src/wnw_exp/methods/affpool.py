"""AffPool (Xiang et al. 2026): training-free merging of adjacent audio tokens by cosine affinity at prefill.

No public code exists; this is the exact recipe implemented here.

Where. Pooling happens on the residual stream at the input of a layer, inside the audio span only, never
across its borders. "Input pooling" is the pooling before layer 0, on the input embeddings (the audio
encoder's output); "deep pooling" is the pooling before a deeper layer, on its input hidden states. The
`window` is the longest run of adjacent tokens one pooling step may merge into one token: window 3 before
every layer except the last `tail_layers`, window 1 (nothing merged) before those. Appendix F states it for
Voxtral-Mini (30 layers: 27 pool, 3 do not); another depth L gets round(tail_layers * L / reference_layers)
non-pooling tail layers (Qwen2.5-Omni-3B, 36 layers: 4; the 3-layer tiny model: 0). Merges accumulate: a
token merged before layer 2 may absorb tokens that were themselves merged before layer 1.

How, at one pooling layer with m audio tokens h_1..h_m:
1. Affinity a_i = cos(h_i, h_{i+1}) of each adjacent pair (float32).
2. Pairs with a_i >= tau are linked; each maximal chain of linked tokens is cut left to right into runs of
   at most `window` tokens; each run becomes one token.
3. The merged hidden state is the mean of the run's states weighted by how many original audio tokens
   each represents (so a merged token is the mean of the originals it covers, as in ToMe's size-weighted
   merging). Its position id is the mean (rounded half to even) of the original positions it covers (for
   M-RoPE, each of the three components), so RoPE sees it at the centre of the audio it stands for; text
   positions never move.
4. The KV of the layer is built from the merged sequence: the store's layer_audio shrinks, its n_audio
   stays the original count.

Retention. r_GPU (§3.4) = mean over layers of (audio tokens of the layer) / n_audio — what the store reports
(AffPool has no CPU tier). A threshold per pooling layer, tau_l, is set by bisection on that layer's sorted
affinities so the layer keeps its count of `layer_counts` (floor(n_audio * rho^(l+1)), at least ceil(m / window) of
the m tokens it receives; ties may leave fewer), where rho, the fraction each pooling layer keeps, is the largest in
[1/window, 1] whose integer counts average at most retention * n_audio (`integer_keep_ratio`): the measured r_GPU
never exceeds the target. A target below what merging `window` tokens into one at every pooling layer reaches is
refused before any sample (`check`). The paper instead calibrates one tau on a held-out
set; one tau per sample cannot be solved inside a single prefill, because a deep layer's affinities
depend on the merges before it. The tau_l are recorded in knobs().
With retention 1.0, rho = 1: nothing is merged and the tokens are exactly Full's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from wnw_exp.methods import register
from wnw_exp.methods.base import Policy


def run_groups(links: torch.Tensor, window: int) -> torch.Tensor:
    """(m - 1,) bool links between adjacent tokens -> (m,) run index of each token (runs of <= window)."""
    m = len(links) + 1
    starts = torch.ones(m, dtype=torch.bool, device=links.device)
    starts[1:] = ~links
    idx = torch.arange(m, device=links.device)
    chain_start = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=0).values
    new_run = (idx - chain_start) % window == 0
    return torch.cumsum(new_run.long(), dim=0) - 1


def merge_threshold(affinity: torch.Tensor, target: int, window: int) -> tuple[float, torch.Tensor]:
    """The largest threshold whose merges leave at most `target` tokens: (tau, run index per token).

    Linking one more pair lowers the token count by at most one, so the count hits `target` exactly unless
    affinities tie; the bisection runs over the number K of top-affinity pairs linked.
    """
    m = len(affinity) + 1
    order = torch.argsort(affinity, descending=True, stable=True)

    def groups(k: int) -> torch.Tensor:
        links = torch.zeros(m - 1, dtype=torch.bool, device=affinity.device)
        links[order[:k]] = True
        return run_groups(links, window)

    lo, hi = 0, m - 1  # count(hi) <= target is guaranteed by the caller (target >= ceil(m / window))
    while lo < hi:
        mid = (lo + hi) // 2
        if int(groups(mid)[-1]) + 1 <= target:
            hi = mid
        else:
            lo = mid + 1
    tau = float(affinity[order[lo - 1]]) if lo > 0 else math.inf
    return tau, groups(lo)


def layer_counts(n_audio: int, rho: float, n_layers: int, n_pool: int, window: int) -> list[int]:
    """Audio tokens each layer keeps at keep ratio `rho`: pooling layer l keeps floor(n_audio * rho^(l + 1)), but
    at least ceil(m / window) of the m tokens it receives (one pooling step merges at most `window` into one) and at
    most m; the layers after the last pooling one keep what it left."""
    counts, m = [], n_audio
    for layer in range(n_layers):
        if layer < n_pool and rho < 1.0:
            m = min(m, max(math.ceil(m / window), math.floor(n_audio * rho ** (layer + 1) + 1e-9)))
        counts.append(m)
    return counts


def integer_keep_ratio(retention: float, n_audio: int, n_layers: int, n_pool: int, window: int) -> float:
    """The largest rho in [1 / window, 1] whose `layer_counts` average at most retention * n_audio per layer, so the
    measured r_GPU never exceeds the target; 1 / window when even that merges too little (the caller refuses)."""
    def fits(rho: float) -> bool:
        return sum(layer_counts(n_audio, rho, n_layers, n_pool, window)) <= retention * n_layers * n_audio + 1e-9

    if fits(1.0):
        return 1.0
    lo, hi = 1.0 / window, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


@register
@dataclass(eq=False)
class AffPool(Policy):
    name = "affpool"
    label, color, marker = "AffPool", "tab:purple", "D"  # how the report shows it
    packed_store = False  # the layers' audio spans shrink: the reference store handles that

    window: int = 3  # longest run merged into one token by one pooling step
    tail_layers: int = 3  # last layers with window 1 (no merging), for a model `reference_layers` deep
    reference_layers: int = 30  # Voxtral-Mini's depth, where Appendix F states the tail
    backbone_info: dict = field(default_factory=dict)

    def pooling_layers(self, n_layers: int) -> int:
        return n_layers - round(self.tail_layers * n_layers / self.reference_layers)

    def check(self, retention: float) -> None:
        """Refuse a target below what merging `window` tokens into one at every pooling layer reaches."""
        n_layers = self.backbone_info.get("n_layers")
        if not n_layers:
            return
        n_pool = self.pooling_layers(n_layers)
        if not n_pool:
            return
        least = sum((1 / self.window) ** min(layer + 1, n_pool) for layer in range(n_layers)) / n_layers
        if retention < least:
            raise ValueError(f"affpool keeps at least r_GPU = {least:.3f} on this {n_layers}-layer model (window "
                             f"{self.window} in {n_pool} pooling layers), above retention={retention}: raise the "
                             "retention or method.window")

    def start(self, ctx, store) -> None:
        super().start(ctx, store)
        self.n_pool = self.pooling_layers(ctx.n_layers)
        self.rho = integer_keep_ratio(ctx.retention, ctx.n_audio, ctx.n_layers, self.n_pool, self.window)
        self.counts = layer_counts(ctx.n_audio, self.rho, ctx.n_layers, self.n_pool, self.window)
        if sum(self.counts) > ctx.retention * ctx.n_layers * ctx.n_audio + 1e-9:
            raise ValueError(f"affpool: {ctx.n_audio} audio tokens merged as far as window {self.window} allows keep "
                             f"r_GPU = {sum(self.counts) / (ctx.n_layers * ctx.n_audio):.3f}, above retention="
                             f"{ctx.retention}: raise the retention")
        self.sizes: torch.Tensor | None = None  # original audio tokens behind each current audio token
        self.centers: torch.Tensor | None = None  # their mean original position, (..., m) float
        self.taus: list[float] = []

    def prefill_transform(self, layer, hidden, positions, audio_span):
        if layer >= self.n_pool or self.rho >= 1.0:
            return hidden, positions, audio_span
        s, e = audio_span
        m = e - s
        target = self.counts[layer]
        if target >= m:
            return hidden, positions, audio_span
        if self.sizes is None:
            self.sizes = torch.ones(m, device=hidden.device, dtype=torch.float32)
            self.centers = positions[..., s:e].float()
        x = hidden[0, s:e].float()
        affinity = F.cosine_similarity(x[:-1], x[1:], dim=-1)
        tau, group = merge_threshold(affinity, target, self.window)
        self.taus.append(tau)
        n_new = int(group[-1]) + 1
        weight = torch.zeros(n_new, device=x.device).index_add_(0, group, self.sizes)
        merged = torch.zeros(n_new, x.shape[1], device=x.device).index_add_(0, group, x * self.sizes[:, None])
        merged = merged / weight[:, None]
        centers = torch.zeros(*self.centers.shape[:-1], n_new, device=x.device)
        centers = centers.index_add_(-1, group, self.centers * self.sizes) / weight
        self.sizes, self.centers = weight, centers
        hidden = torch.cat([hidden[:, :s], merged[None].to(hidden.dtype), hidden[:, e:]], dim=1)
        audio_pos = torch.round(centers).to(positions.dtype)
        positions = torch.cat([positions[..., :s], audio_pos, positions[..., e:]], dim=-1)
        return hidden, positions, (s, s + n_new)

    def knobs(self) -> dict:
        return dict(rho=self.rho, n_pool_layers=self.n_pool, tau=[round(t, 4) for t in self.taus])
