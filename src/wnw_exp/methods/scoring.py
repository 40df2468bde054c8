"""Shared scoring pieces of the baselines: SnapKV observation-window scores, 1-D pooling, GQA group
averaging, the AdaKV per-head budget allocation, and budgets spread evenly over (layer, KV head) pairs.

Plain functions on tensors, so the peer check (benchmarks/peer_check_kvpress.py) can compose them in
kvpress's order as well as in AdaKV's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def window_mean(post_audio: torch.Tensor, window: int) -> torch.Tensor:
    """(H_q, n_post, n) softmax weights -> (H_q, n): the mean over the last `window` rows (all if fewer).

    The rows are the prompt tokens after the audio, SnapKV's observation window restricted to text that
    follows the audio (§3.3: only the audio region is scored and compressed).
    """
    if post_audio.shape[1] == 0:
        raise ValueError("SnapKV scoring needs at least one prompt token after the audio (the observation window)")
    return post_audio[:, -window:].float().mean(dim=1)


def pool1d(scores: torch.Tensor, kernel: int, mode: str) -> torch.Tensor:
    """Smooth (H, n) scores along positions with a same-length pool (stride 1, padding kernel // 2).

    'max' pads with -inf (a border position sees only real neighbours); 'avg' pads with zeros and divides
    by `kernel` (torch's count_include_pad default), exactly as SnapKV, AdaKV and kvpress call them.
    """
    if kernel % 2 != 1:
        raise ValueError(f"pooling kernel must be odd to keep the length, got {kernel}")
    if kernel == 1:
        return scores
    x = scores[:, None, :]
    if mode == "max":
        out = F.max_pool1d(x, kernel_size=kernel, stride=1, padding=kernel // 2)
    elif mode == "avg":
        out = F.avg_pool1d(x, kernel_size=kernel, stride=1, padding=kernel // 2)
    else:
        raise ValueError(f"pooling must be 'max' or 'avg', got {mode!r}")
    return out[:, 0, :]


def group_mean(scores: torch.Tensor, group: int) -> torch.Tensor:
    """(H_q, n) -> (H_kv, n): the mean over each KV head's GQA group of query heads."""
    h_q, n = scores.shape
    return scores.view(h_q // group, group, n).mean(dim=1)


def snapkv_scores(post_audio: torch.Tensor, *, window: int, kernel: int, pooling: str, group: int) -> torch.Tensor:
    """SnapKV scores of the audio positions per KV head, (H_kv, n), in AdaKV's order.

    Window mean, then the GQA group mean, then pooling: AdaKV's `calcul_attn_sore` with gqa_support and
    gqa_func='mean'. kvpress pools each query head before the group mean; for max pooling the two orders
    differ (max does not commute with the mean) — see the peer check.
    """
    return pool1d(group_mean(window_mean(post_audio, window), group), kernel, pooling)


def adakv_capacities(scores: torch.Tensor, budget: int, floor_alpha: float) -> torch.Tensor:
    """AdaKV's per-head budgets for one layer, (H_kv,) long, from (H_kv, n) scores and a per-head mean `budget`.

    As in AdaKV's code (`AdaptiveSnapKVCluster.update_kv_gqa`): take the layer's top H_kv * budget scores
    across all heads, let c_h be how many of them head h holds, and give head h
    round(c_h * (1 - floor_alpha) + int(budget * floor_alpha)) positions: a guaranteed floor of
    floor_alpha * budget per head plus a share of the rest in proportion to its share of the layer's top
    scores. The total is H_kv * budget up to the rounding of each head (at most H_kv / 2 + H_kv positions
    per layer). Capped at n.
    """
    h, n = scores.shape
    flat_top = torch.topk(scores.reshape(-1), k=h * budget).indices // n
    counts = torch.bincount(flat_top, minlength=h).double()
    floor = int(budget * floor_alpha)
    return torch.round(counts * (1 - floor_alpha) + floor).long().clamp(max=n)


def trim_to_total(caps: torch.Tensor, total: int) -> torch.Tensor:
    """(H,) per-head budgets whose sum is at most `total`: the excess of `adakv_capacities`' per-head rounding (at most
    H / 2 positions, so one token from each of the largest budgets, ties: the earlier head) is taken back. Tensor
    ops only (no host read)."""
    excess = (caps.sum() - total).clamp(min=0)
    order = torch.argsort(caps, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(len(caps), device=caps.device))
    return caps - (rank < excess).long()


def top_masks(scores: torch.Tensor, caps: torch.Tensor) -> torch.Tensor:
    """(..., n) bool: per row of `scores` (..., n) (a head, or a block of a head), its top caps[...] positions by
    score (ties: the earlier position first), from one stable sort of every row; caps (...) integer, at most n.
    No host read."""
    n = scores.shape[-1]
    order = torch.argsort(scores, dim=-1, descending=True, stable=True)
    first = torch.arange(n, device=scores.device) < torch.as_tensor(caps, device=scores.device)[..., None]
    return torch.zeros_like(first).scatter_(-1, order, first)


def keep_top(scores: torch.Tensor, caps: torch.Tensor) -> list[torch.Tensor]:
    """Per head h, its top caps[h] positions by score, sorted by position (ties: the earlier position first)."""
    return [m.nonzero().flatten() for m in top_masks(scores, caps)]


def spread_budget(total: int, n_slots: int) -> list[int]:
    """Split an integer `total` over `n_slots` as evenly as possible, the +1s spaced out (Bresenham).

    Slot i gets floor((i + 1) * total / n_slots) - floor(i * total / n_slots).
    """
    return [(i + 1) * total // n_slots - i * total // n_slots for i in range(n_slots)]


def balanced_bounds(n: int, max_size: int) -> torch.Tensor:
    """Boundaries (n_pages + 1,) of ceil(n / max_size) contiguous pages whose sizes differ by at most one."""
    n_pages = max(1, math.ceil(n / max_size))
    sizes = torch.tensor(spread_budget(n, n_pages), dtype=torch.long)
    return torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
