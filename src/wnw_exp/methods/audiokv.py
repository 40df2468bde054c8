"""AudioKV baseline (Wang et al. 2026; Appendix F): voice-score-guided per-head budget, FFT-smoothed
SnapKV-style scores, prefill-only eviction of the audio region.

No public code exists, so this is the exact recipe implemented (hyperparameters α=0.5, ρ=0.7,
observation window 32, baseline ratio 0.5 from Appendix F; voice scores from the same calibration as
WnW, WhisperX min_word_score 0.85):

1. Budget (SparseMM/HeadKV-style allocation). With n_a audio tokens, L·H KV heads and target r, the
   total budget is B = floor(r · L·H · n_a) audio positions (never above the target). Every head gets the
   uniform floor b0 = baseline_ratio · B / (L·H); the remaining pool B − L·H·b0 is shared in proportion to the heads'
   voice scores VS_i / Σ VS (uniformly if every VS is 0). A head cannot keep more than n_a: the excess
   is re-shared among the heads below n_a in the same proportions (water filling). Budgets are floored
   to integers and the positions left over go to the heads with the largest fractional parts, so the
   heads keep exactly B positions (r_GPU = target up to one position in L·H·n_a).
2. Scores. The observation window is the last `window` (32) prompt tokens, as in SnapKV and the
   original AudioKV, which compress the whole sequence: with only a few text tokens after the audio
   (Voxtral's prompt has ~3), most window rows are the last audio tokens (the engine's
   `PrefillScores.last_window`; Ada-KV instead uses only the text after the audio, as specified). A
   head's score of audio position τ is the softmax weight of the window's rows at τ, averaged over the
   window and over the head's GQA query heads: s (n_a,).
3. FFT smoothing. S = rfft(s); a low-pass filter keeps the lowest ceil(ρ · len(S)) frequency bins and
   zeroes the rest; s_low = irfft(·, n_a). The smoothed score is α · s_low + (1 − α) · s.
4. Eviction. Each head keeps its top-b_i audio positions by the smoothed score (ties: earlier
   position) on the device; the rest are dropped (no CPU tier). Text KV is never touched (§3.3).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from wnw_exp.head_scores import resolve_head_scores
from wnw_exp.kv.base import KVStore
from wnw_exp.methods import register
from wnw_exp.methods.base import Placement, Policy, PrefillScores, SampleContext
from wnw_exp.methods.scoring import top_masks


def head_budgets(voice_score: np.ndarray, retention: float, n_audio: int, baseline_ratio: float) -> np.ndarray:
    """Integer audio budget per (layer, KV head), summing to floor(retention · heads · n_audio) (step 1)."""
    vs = np.clip(np.asarray(voice_score, dtype=np.float64), 0, None)
    n_heads = vs.size
    total = min(int(retention * n_heads * n_audio + 1e-9), n_heads * n_audio)  # floor: never above the target
    weights = vs.ravel() / vs.sum() if vs.sum() > 0 else np.full(n_heads, 1.0 / n_heads)
    floor = baseline_ratio * total / n_heads
    budget = np.full(n_heads, min(floor, n_audio), dtype=np.float64)
    pool = total - budget.sum()
    open_ = budget < n_audio
    while pool > 1e-9 and open_.any():
        w = weights * open_
        w = w / w.sum() if w.sum() > 0 else open_ / open_.sum()
        budget += pool * w
        over = np.clip(budget - n_audio, 0, None)
        budget = np.minimum(budget, n_audio)
        pool = over.sum()
        open_ = budget < n_audio - 1e-9
    ints = np.floor(budget + 1e-9).astype(np.int64)
    left = int(total - ints.sum())
    if left > 0:
        frac = np.where(ints < n_audio, budget - ints, -1.0)
        ints[np.argsort(-frac, kind="stable")[:left]] += 1
    return ints.reshape(np.shape(voice_score))


def fft_smooth(scores: torch.Tensor, alpha: float, rho: float) -> torch.Tensor:
    """α · lowpass_ρ(s) + (1 − α) · s along the last dim (step 3)."""
    n = scores.shape[-1]
    if n < 2:
        return scores
    spec = torch.fft.rfft(scores.float(), dim=-1)
    keep = max(1, math.ceil(rho * spec.shape[-1]))
    spec[..., keep:] = 0
    low = torch.fft.irfft(spec, n=n, dim=-1)
    return alpha * low + (1 - alpha) * scores.float()


@register
class AudioKV(Policy):
    name = "audiokv"
    label, color, marker = "AudioKV", "tab:orange", "^"  # how the report shows it

    def __init__(self, head_scores: str | None = None, alpha: float = 0.5, rho: float = 0.7, window: int = 32,
                 baseline_ratio: float = 0.5, backbone_info: dict | None = None, scores=None):
        self.scores = scores if scores is not None else resolve_head_scores(head_scores, backbone_info or {})
        if not 0 <= alpha <= 1 or not 0 < rho <= 1 or window < 1 or not 0 <= baseline_ratio <= 1:
            raise ValueError("audiokv: alpha and baseline_ratio must be in [0, 1], rho in (0, 1], window >= 1")
        self.alpha, self.rho, self.window, self.baseline_ratio = float(alpha), float(rho), int(window), float(baseline_ratio)

    def start(self, ctx: SampleContext, store: KVStore) -> None:
        super().start(ctx, store)
        if (ctx.n_layers, ctx.n_kv_heads) != self.scores.voice_score.shape:
            raise ValueError(f"voice scores are for {self.scores.voice_score.shape} (layers, KV heads), the model has "
                             f"{(ctx.n_layers, ctx.n_kv_heads)}")
        self.budget = head_budgets(self.scores.voice_score, ctx.retention, ctx.n_audio, self.baseline_ratio)

    def place(self, layer: int, scores: PrefillScores) -> Placement | None:
        rows = scores.last_window if scores.last_window is not None else scores.post_audio
        post = rows[:, -self.window:]  # (H_q, w, n_audio)
        H, g = self.ctx.n_kv_heads, self.ctx.group
        n_a = post.shape[-1]
        if post.shape[1] == 0:  # no prompt token after the audio: nothing observes it, keep the earliest
            post = post.new_zeros(post.shape[0], 1, n_a)
        s = post.float().mean(dim=1).view(H, g, n_a).mean(dim=1)  # (H_kv, n_audio)
        smooth = fft_smooth(s, self.alpha, self.rho)
        budget = np.minimum(self.budget[layer], n_a)
        placed = budget < n_a  # a head whose budget covers its audio keeps everything, untouched
        if not placed.any():
            return None
        # each placed head's top `budget` positions (ties: the earlier), the layer in one placement
        return Placement(top_masks(smooth, torch.as_tensor(budget)), select=torch.as_tensor(placed))

    def knobs(self) -> dict:
        return dict(alpha=self.alpha, rho=self.rho, window=self.window, baseline_ratio=self.baseline_ratio,
                    head_scores=self.scores.path)
