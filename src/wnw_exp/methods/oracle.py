"""Oracle: the upper bound of any audio-KV eviction policy at r_GPU = r. Not deployable.

At every decode step, before a layer's attention (`before_attention`, the step's query in hand), each KV head
computes that step's true attention over its whole audio (softmax of q.k / sqrt(d) over the dense keys and
every audio key, summed over the head's GQA group of query heads) and keeps on the device only its own top
floor(r * n_audio) audio positions (`granularity: token`), or its top floor(r * n_audio / block) blocks of
`chunk_seconds` (`granularity: chunk`, non-overlapping blocks of ceil(chunk_seconds * r_tok) tokens ranked
by the attention mass they hold; all of them at r = 1). The attention of that step then runs on exactly those
positions, so r_GPU is at most r at every step (floored: never above it).

To know the true attention it needs every audio key at every step: it keeps its own copy of them beside the
store and a host mirror of all audio (r_GPU+CPU = 1). The moves it makes each step are counted as host-to-
device traffic like any recall; they say nothing about a real system. From prefill to its first decode step a
layer keeps the top blocks of the prompt's last row, so the first step too holds no more than the kept share. The
new token's own key (appended by the attention itself) is left out of the ranking's softmax, a single key among
hundreds. The ranking stays on the device; its decision is data, a code per (head, block) (1 recall, 2 release),
which the store queues (`queue_pages`) and applies in one flush before the layer's attention. Each head's region
keeps room for all its audio, so a step's recalls always find room.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from wnw_exp.methods import register
from wnw_exp.methods.base import Placement, Policy, PrefillScores

GRANULARITIES = ("token", "chunk")


@register
@dataclass(eq=False)
class Oracle(Policy):
    name = "oracle"
    # How the report shows it: not deployable (it needs every step's true attention), the bound any eviction
    # policy can reach; one curve per granularity: (label, the knobs that select its runs, line style).
    label, color, marker, role = "Oracle (bound)", "0.45", "x", "bound"
    variants = (("Oracle, top tokens (bound)", (("granularity", "token"),), ":"),
                ("Oracle, top 4 s blocks (bound)", (("granularity", "chunk"),), "-."))
    graph_safe = False  # its ranking cuts the dense keys at the host's count of them (`dense_keys`)
    cpu_tier = True

    granularity: str = "token"
    chunk_seconds: float = 4.0
    backbone_info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"method.granularity={self.granularity!r}: choose one of {', '.join(GRANULARITIES)}")
        if self.chunk_seconds <= 0:
            raise ValueError("method.chunk_seconds must be > 0")

    def start(self, ctx, store) -> None:
        super().start(ctx, store)
        n = ctx.n_audio
        self.block = 1 if self.granularity == "token" else max(1, math.ceil(self.chunk_seconds * ctx.token_rate - 1e-9))
        self.n_blocks = math.ceil(n / self.block) if n else 0
        # the most blocks whose tokens, the largest blocks taken, stay within retention * n_audio (the promise)
        sizes = sorted((min(self.block, n - b * self.block) for b in range(self.n_blocks)), reverse=True)
        self.k_blocks = int(np.searchsorted(np.cumsum(sizes), ctx.retention * n + 1e-9, side="right"))
        self.keys: dict[int, torch.Tensor] = {}  # layer -> (H_kv, n_audio, D) every audio key after RoPE
        self.resident: dict[int, torch.Tensor] = {}  # layer -> (H_kv, n_blocks) bool, on the device
        self._block_of = torch.arange(n, device=ctx.device) // self.block  # (n_audio,) each position's block
        self.scale = ctx.head_dim ** -0.5
        self.recall_headroom = n  # any head may hold any of its positions (its region keeps them all)

    def place(self, layer: int, scores: PrefillScores) -> Placement | None:
        if self.k_blocks >= self.n_blocks:
            return None  # r = 1: everything stays, nothing moves
        keys = scores.audio_keys
        if keys.shape[1] != self.ctx.n_audio:
            raise ValueError("the oracle ranks the prompt's audio tokens; it cannot follow a merging method")
        self.keys[layer] = keys.clone()
        # Until its first decode step the layer keeps the top blocks of the prompt's last row (the row that emits the
        # first answer token), so that no step, the first included, sees more than the kept share on the device.
        H, g = self.ctx.n_kv_heads, self.ctx.group
        last = (scores.last_window if scores.last_window is not None else scores.post_audio)[:, -1]
        blocks = self.keep_blocks(last.float().view(H, g, -1).sum(dim=1)).to(self.ctx.device)
        self.resident[layer] = blocks
        keep = self.positions(blocks).cpu()
        return Placement(keep, torch.ones_like(keep))  # every position mirrored on the host

    def true_attention(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """(H_kv, n_audio): the step's softmax weights at the audio positions, summed over each GQA group."""
        return true_audio_attention(q, self.keys[layer], self.store.dense_keys(layer), self.scale)

    def keep_blocks(self, attention: torch.Tensor) -> torch.Tensor:
        """(H_kv, n_blocks) bool: each head's top k_blocks blocks by attention mass (ties: the earlier block)."""
        H, n = attention.shape
        pad = self.n_blocks * self.block - n
        mass = torch.cat([attention, attention.new_zeros(H, pad)], dim=1).view(H, self.n_blocks, self.block).sum(-1)
        top = torch.sort(mass, dim=-1, descending=True, stable=True).indices[:, : self.k_blocks]
        keep_blocks = torch.zeros(H, self.n_blocks, dtype=torch.bool, device=attention.device)
        return keep_blocks.scatter_(1, top, True)

    def positions(self, blocks: torch.Tensor) -> torch.Tensor:
        """(H_kv, n_audio) bool: the positions of the blocks set in `blocks` (H_kv, n_blocks)."""
        return blocks.repeat_interleave(self.block, dim=1)[:, : self.ctx.n_audio]

    def before_attention(self, layer: int, q: torch.Tensor) -> None:
        if layer not in self.keys:
            return
        keep = self.keep_blocks(self.true_attention(layer, q))
        resident = self.resident[layer]
        codes = (keep & ~resident).to(torch.int8) + 2 * (resident & ~keep).to(torch.int8)
        self.store.queue_pages(layer, self._block_of, codes)
        self.store.flush(layer)  # in force for this layer's attention
        self.resident[layer] = keep

    def knobs(self) -> dict:
        return dict(granularity=self.granularity, block_tokens=self.block, kept_blocks=self.k_blocks,
                    n_blocks=self.n_blocks)


def true_audio_attention(q: torch.Tensor, audio_keys: torch.Tensor, dense_keys: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """(H_kv, n_audio): the full-cache softmax weights of query `q` (H_q, D) at every audio key (H_kv, n_audio, D),
    normalised together with the non-audio keys `dense_keys` (H_kv, n, D), summed over each GQA group."""
    H = audio_keys.shape[0]
    qg = q.view(H, q.shape[0] // H, -1).float()
    s_audio = torch.einsum("hgd,hnd->hgn", qg, audio_keys.float()) * scale
    s_dense = torch.einsum("hgd,hnd->hgn", qg, dense_keys.float()) * scale
    lse = torch.logsumexp(torch.cat([s_dense, s_audio], dim=-1), dim=-1, keepdim=True)
    return torch.exp(s_audio - lse).sum(dim=1)
