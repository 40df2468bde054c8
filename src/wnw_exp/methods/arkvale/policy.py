"""ArkVale (Chen et al. 2024): page-based recallable eviction with key digests, on the audio region (§3.3).

Recipe (per layer, per KV head; the text — ArkVale's sink and recent-window pages — stays in the dense part):
1. Pages. A layer's n audio positions are cut into ceil(n / 32) contiguous pages whose sizes differ by at
   most one token (31-32 for n >= 32·k). ArkVale pages the whole sequence from position 0, so in the audio
   region its first and last pages would be partial anyway; equal sizes keep r_GPU on target when only a
   few pages are resident.
2. Digests (ArkVale's `_summarize_keys`), from the post-RoPE keys of each page: center = (max + min) / 2
   per dimension, dist = mean |center - k| per dimension, hi = center + dist, lo = center - dist.
3. Budget. About retention * n_pages resident pages per head: the most pages, spread over the (layer, head) pairs as
   floor/ceil (the +1s spaced evenly), whose tokens stay within retention * n_audio * L * H_kv even when every
   head holds its largest pages (`page_total`), so r_GPU never exceeds the target at any step. top-k:
   k = max(1, floor(topk_fraction * P_head)) pages (ArkVale's default page_topks = budget // 2).
4. Prefill. Each head keeps its P_head best pages on the device, and every page, resident or not, gets a
   host copy (ArkVale's `prefill_backup_pages`: a full CPU mirror, so r_GPU+CPU = 1 and any page can be
   released later without loss). The page score at prefill is the attention of the
   last prompt token, max over the page's positions, mean over the head's GQA group. (ArkVale scores the
   digests against that token's query; the engine hands policies the attention weights instead, of which
   the digest score is a bound — and the first decode step re-selects with digests anyway.)
5. Each decode step, before attention (`before_attention`): page score = sum_d max(q_d * hi_d, q_d * lo_d),
   mean over the head's GQA query heads (ArkVale's `estimate_scores` kernel and its group mean). The top-k
   pages must be resident: each missing one is recalled from the host, and to make room the resident page
   outside the top-k with the lowest score is released (its host copy persists) — ArkVale's `select_topk`.
   Resident pages that stay above the lowest scores stay, so the resident count is always P_head.
With retention 1.0 every page is resident and nothing moves: exactly Full's tokens.

Where step 5 runs: on the reference store (the CPU) per head on the host (`swap_head`, the specification);
on a store that queues its moves (the packed GPU store) on the device (`swap_pages`: the page scores, the
top-k, the victims and the resident pages are tensors; ties are broken by page index, where the host's
torch.topk leaves them unspecified), with the moves handed to the store as fixed-shape masks and flushed for the
layer at once: ArkVale proper's timing (recall before the layer's attention) inside the step's CUDA graph. With
the store's Triton kernels the whole swap and its queueing is one kernel per layer (`kernels.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from wnw_exp.methods import register
from wnw_exp.methods.base import Placement, Policy, PrefillScores
from wnw_exp.methods.scoring import balanced_bounds, spread_budget


def page_table(bounds: torch.Tensor, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_pages, max page size) audio positions of each page, and which entries are real (not padding)."""
    starts, sizes = bounds[:-1, None], (bounds[1:] - bounds[:-1])[:, None]
    offset = torch.arange(int(sizes.max()))[None]
    valid = offset < sizes
    return torch.where(valid, starts + offset, starts).to(device), valid.to(device)


def page_total(bounds: torch.Tensor, slots: int, tokens: float) -> int:
    """The most pages, spread over `slots` heads as `spread_budget` spreads them, whose tokens cannot exceed `tokens`
    whichever pages each head holds: a head with P pages may hold the P largest (pages differ by one token, and the
    swap trades any page for any other), so its worst case is their sum. Bisection over the total (the worst case
    grows with it)."""
    largest = torch.cat([torch.zeros(1, dtype=torch.long), torch.sort(bounds.diff(), descending=True).values.cumsum(0)])
    n_pages = len(largest) - 1

    def worst(total: int) -> int:
        return sum(int(largest[p]) for p in spread_budget(total, slots))

    lo, hi = 0, n_pages * slots  # worst(lo) <= tokens
    if worst(hi) <= tokens + 1e-9:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if worst(mid) <= tokens + 1e-9 else (lo, mid)
    return lo


def key_digests(keys: torch.Tensor, bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, D) keys and page bounds -> (hi, lo), each (n_pages, D) in the keys' dtype (ArkVale keeps its
    digests in the KV pool): center ± mean absolute deviation per dimension, computed in float32."""
    idx, valid = page_table(bounds, keys.device)
    k = keys.float()[idx]  # (n_pages, S, D)
    pad = ~valid[..., None]
    center = (k.masked_fill(pad, -math.inf).amax(dim=1) + k.masked_fill(pad, math.inf).amin(dim=1)) / 2
    dist = (k - center[:, None]).abs().masked_fill(pad, 0).sum(dim=1) / valid.sum(dim=1, keepdim=True)
    return (center + dist).to(keys.dtype), (center - dist).to(keys.dtype)


def page_scores(q: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """q (H_kv, g, D) grouped by KV head, digests (H_kv, n_pages, D) -> (H_kv, n_pages) page scores.

    sum_d max(q_d * hi_d, q_d * lo_d) per query head, then the mean over each KV head's group.
    """
    q = q.float()[:, :, None, :]
    hi, lo = hi.float()[:, None], lo.float()[:, None]
    return torch.maximum(q * hi, q * lo).sum(dim=-1).mean(dim=1)


@register
@dataclass(eq=False)
class ArkVale(Policy):
    name = "arkvale"
    label, color, marker = "ArkVale", "tab:blue", "s"  # how the report shows it
    graph_safe = True  # on a queuing store step 5 runs on the device
    cpu_tier = True

    page_size: int = 32  # at most this many audio tokens per page
    topk_fraction: float = 0.5  # pages that must be resident each step, as a fraction of the page budget
    backbone_info: dict = field(default_factory=dict)

    def start(self, ctx, store) -> None:
        super().start(ctx, store)
        self.bounds = balanced_bounds(ctx.n_audio, self.page_size)
        n_pages = len(self.bounds) - 1
        slots = ctx.n_layers * ctx.n_kv_heads
        flat = spread_budget(page_total(self.bounds, slots, ctx.retention * ctx.n_audio * slots), slots)
        self.budget = [flat[i * ctx.n_kv_heads:(i + 1) * ctx.n_kv_heads] for i in range(ctx.n_layers)]
        # The packed GPU store applies releases lazily: a head may gain k pages before they are freed, and
        # swapping pages of 31 and 32 tokens can grow its resident count by up to one token per page.
        most = max(flat, default=0)
        self.recall_headroom = self.page_size * max(1, math.floor(self.topk_fraction * most)) + most
        self.digests: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (hi, lo) (H_kv, n_pages, D)
        self.resident: dict[int, torch.Tensor] = {}  # layer -> (H_kv, n_pages) bool (on the device on a queuing store)
        self.n_recalled_pages = 0
        self.on_device = bool(store.queues_moves)
        if self.on_device:
            dev = ctx.device
            self._recalled = torch.zeros((), dtype=torch.long, device=dev)
            self._page_of = torch.repeat_interleave(torch.arange(n_pages), self.bounds.diff()).to(dev)  # (n_audio,)
            budget = torch.as_tensor(self.budget, device=dev)  # (L, H)
            self._budget = budget
            self._k = torch.clamp(torch.floor(self.topk_fraction * budget.double()).long(), min=1)
            self._scratch: dict = {}  # the swap kernel's buffers

    def _positions(self, pages: torch.Tensor) -> torch.Tensor:
        b = self.bounds
        return torch.cat([torch.arange(int(b[p]), int(b[p + 1])) for p in pages.tolist()]) if len(pages) \
            else torch.empty(0, dtype=torch.long)

    def place(self, layer: int, scores: PrefillScores) -> Placement | None:
        n_pages = len(self.bounds) - 1
        if all(p == n_pages for p in self.budget[layer]):
            return None  # everything stays resident: Full
        if scores.post_audio.shape[-1] != self.ctx.n_audio:
            raise ValueError("arkvale pages the prompt's audio tokens; it cannot follow a merging method")
        last = scores.post_audio[:, -1].float()  # (H_q, n): attention of the last prompt token
        idx, valid = page_table(self.bounds, last.device)
        page_max = last[:, idx].masked_fill(~valid, -math.inf).amax(dim=-1)  # (H_q, n_pages)
        prefill = page_max.view(self.ctx.n_kv_heads, self.ctx.group, n_pages).mean(dim=1).cpu()
        his, los, res = [], [], []
        for head in range(self.ctx.n_kv_heads):
            hi, lo = key_digests(scores.audio_keys[head], self.bounds)
            his.append(hi)
            los.append(lo)
            keep = torch.topk(prefill[head], self.budget[layer][head]).indices
            resident = torch.zeros(n_pages, dtype=torch.bool)
            resident[keep] = True
            res.append(resident)
        self.digests[layer] = (torch.stack(his), torch.stack(los))
        pages = torch.stack(res)
        self.resident[layer] = pages.to(self.ctx.device) if self.on_device else pages
        # The CPU mirror holds every page, resident ones included, so any page can be released later.
        gpu = pages[:, torch.repeat_interleave(torch.arange(n_pages), self.bounds.diff())]  # (H_kv, n_audio)
        return Placement(gpu, torch.ones_like(gpu))

    def before_attention(self, layer: int, q: torch.Tensor) -> None:
        if layer not in self.resident:
            return
        if self.on_device:
            self._swap_device(layer, q)
            return
        hi, lo = self.digests[layer]
        self.select_pages(layer, page_scores(q.view(self.ctx.n_kv_heads, self.ctx.group, -1), hi, lo).cpu())

    def select_pages(self, layer: int, scores: torch.Tensor) -> None:
        """Step 5's page swap of `layer` from its (H_kv, n_pages) page scores, on the host, per head in its row
        order (the reference store appends each head's recalled positions in the order given)."""
        if layer not in self.resident:
            return
        for head in range(self.ctx.n_kv_heads):
            victims, missing = self.swap_head(layer, head, scores[head])
            if len(missing):
                row = layer * self.ctx.n_kv_heads + head
                self.store.release(row, self._positions(victims))
                self.store.recall(row, self._positions(missing))

    def swap_head(self, layer: int, head: int, score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One head's swap (ArkVale's `select_topk`); updates `resident`, returns (victim, missing) pages."""
        none = torch.zeros(0, dtype=torch.long)
        p_head = self.budget[layer][head]
        if p_head == 0:
            return none, none
        k = max(1, math.floor(self.topk_fraction * p_head))
        top = torch.topk(score, k).indices
        resident = self.resident[layer][head]
        missing = top[~resident[top]]
        if len(missing) == 0:
            return none, none
        candidates = resident.clone()
        candidates[top] = False  # never evict a page of this step's top-k
        pool = candidates.nonzero().flatten()
        victims = pool[torch.topk(score[pool], len(missing), largest=False).indices]
        resident[victims] = False
        resident[missing] = True
        self.n_recalled_pages += len(missing)
        return victims, missing

    def swap_pages(self, layer: int, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`swap_head` for every head of `layer` at once, on device tensors (graph-safe): scores (H_kv, n_pages)
        -> (victims, missing) bool masks (H_kv, n_pages); updates `resident[layer]` in place. The top-k pages by
        score (ties: the lower page) must be resident; each missing one displaces the resident page outside the
        top-k with the lowest score (ties: the lower page)."""
        resident, P = self.resident[layer], scores.shape[1]
        ar = torch.arange(P, device=scores.device).expand_as(scores)
        rank = torch.empty_like(ar).scatter_(1, torch.sort(scores, dim=1, descending=True, stable=True).indices, ar)
        top = rank < self._k[layer][:, None]
        missing = top & ~resident & (self._budget[layer] > 0)[:, None]
        candidates = resident & ~top
        low = torch.where(candidates, scores, torch.full_like(scores, math.inf))
        rank_low = torch.empty_like(ar).scatter_(1, torch.sort(low, dim=1, stable=True).indices, ar)
        victims = candidates & (rank_low < missing.sum(dim=1, keepdim=True))
        resident.copy_((resident & ~victims) | missing)
        return victims, missing

    def _swap_device(self, layer: int, q: torch.Tensor) -> None:
        hi, lo = self.digests[layer]
        if self.store.kernels == "triton":  # the same decision in one kernel (kernels.py)
            from wnw_exp.methods.arkvale.kernels import swap

            codes = swap(q, hi, lo, self.resident[layer], self._k[layer], self._budget[layer], self._recalled,
                         self._scratch)
        else:
            victims, missing = self.swap_pages(layer, page_scores(q.view(self.ctx.n_kv_heads, self.ctx.group, -1),
                                                                  hi, lo))
            codes = missing.to(torch.int8) + 2 * victims.to(torch.int8)
            self._recalled += missing.sum()
        self.store.queue_pages(layer, self._page_of, codes)  # the decision as data: the store queues the moves
        self.store.flush(layer)  # in force for this layer's attention, as in ArkVale

    def knobs(self) -> dict:
        n_pages = len(self.bounds) - 1
        mean_budget = sum(map(sum, self.budget)) / (self.ctx.n_layers * self.ctx.n_kv_heads)
        recalled = self.n_recalled_pages + (int(self._recalled) if self.on_device else 0)
        return dict(n_pages=n_pages, page_budget=mean_budget, recalled_pages=recalled)
