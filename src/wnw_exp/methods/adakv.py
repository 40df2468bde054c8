"""Ada-KV (Feng et al. 2025) on SnapKV scores, restricted to the audio region (§3.3).

Recipe, per layer, at prefill (`place`):
1. Scores. The engine's `post_audio` holds the softmax weights from each prompt token after the audio to
   the audio positions (each row normalised over every key it sees, as in the prefill attention). SnapKV's
   observation window is the last `window_size` of those rows (all of them when fewer: a transcription
   prompt has only a few tokens after the audio). Mean over the window rows -> mean over each KV head's GQA
   group of query heads -> max pooling along positions with kernel 7 (stride 1, same length, -inf
   padding), all on the audio columns only. This is AdaKV's code order (`gqa_func='mean'` before pooling).
2. Budget. B = floor(retention * n_audio) positions per KV head on average, H_kv * B for the layer (floored, not
   rounded: the layer never holds more than the target, the retention promise of docs/reliability.md).
3. Allocation (AdaKV's code): c_h = how many of the layer's top H_kv * B scores head h holds; head h keeps
   its top round(c_h * (1 - floor_alpha) + int(B * floor_alpha)) positions, floor_alpha = 0.8. AdaKV's per-head
   rounding can add up to H_kv / 2 positions to the layer; they are taken back from the largest budgets
   (`scoring.trim_to_total`), so the layer keeps at most H_kv * B.
4. The rest is dropped for good: one `Placement` of the layer's heads, kept masks only (one stable sort
   for the layer, `scoring.top_masks`); there is no CPU tier, so r_GPU = r_GPU+CPU.
With B >= n_audio (retention 1.0) nothing is touched, so the method then gives exactly Full's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from wnw_exp.methods import register
from wnw_exp.methods.base import Placement, Policy, PrefillScores
from wnw_exp.methods.scoring import adakv_capacities, snapkv_scores, top_masks, trim_to_total


@register
@dataclass(eq=False)
class AdaKV(Policy):
    name = "adakv"
    label, color, marker = "Ada-KV", "tab:red", "v"  # how the report shows it

    floor_alpha: float = 0.8  # fraction of the mean per-head budget every head is guaranteed
    kernel_size: int = 7  # pooling kernel along audio positions
    pooling: str = "max"  # 'max' (Appendix F) or 'avg' (SnapKV's and kvpress's default)
    window_size: int = 32  # observation window: at most this many prompt tokens after the audio
    backbone_info: dict = field(default_factory=dict)

    def start(self, ctx, store) -> None:
        super().start(ctx, store)
        self._caps: list[torch.Tensor] = []  # each placed layer's per-head budgets

    def place(self, layer: int, scores: PrefillScores) -> Placement | None:
        n = scores.post_audio.shape[-1]
        budget = int(self.ctx.retention * n + 1e-9)  # floor (0.2 * 25 = 4.999...: the epsilon keeps the 5)
        if budget >= n:
            return None
        s = snapkv_scores(scores.post_audio, window=self.window_size, kernel=self.kernel_size,
                          pooling=self.pooling, group=self.ctx.group)
        caps = trim_to_total(adakv_capacities(s, budget, self.floor_alpha), s.shape[0] * budget)
        self._caps.append(caps)  # read at the end (`knobs`): no host read per layer here
        return Placement(top_masks(s, caps))

    def knobs(self) -> dict:
        """The spread of the per-head budgets AdaKV chose, as fractions of the audio tokens."""
        if not self._caps:
            return {}
        caps = torch.cat(self._caps).tolist()
        n = self.ctx.n_audio
        return dict(head_budget_min=min(caps) / n, head_budget_max=max(caps) / n)
