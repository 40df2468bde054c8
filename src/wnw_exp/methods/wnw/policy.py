"""WnW (§2.2-2.3): anchor / tidal / fixed heads, per-segment prefill selection, decode-time chunk swap.

Triage (once per retention target, from `method.head_scores`): heads ranked by VS x HS (or VS, HS:
`signal`, ablation A3); the top `n_voice` are voice heads (`all`: every head), the top `n_anchor` of those anchors,
the other voice heads tidal, the rest fixed. Non-anchor heads keep retention_i = min(s~_i lambda, 1) of
their audio, s~ = score / max score over non-anchor heads.

lambda (`lam: auto`) is solved per sample, by bisection (it depends on the sample only through its audio length: it
is solved once per length and target, and a policy's forks share it, `WnW._solution`). With `recall_budget: peak`
(the default) it is the largest lambda whose peak r_GPU fits the target, so that no decode step holds more (the
retention promise, docs/reliability.md): the prefill footprint (anchors whole, the exact per-segment floors) plus
each tidal head's recall room, its host-tier positions in the `peak_recalled_segments` segments the chunk swap can
hold recalled at once (`triage.recall_room`, `triage.solve_peak_lambda`); the packed store reserves that room, read
from the placed masks (`recall_headroom`). Where even lambda = 0 does not fit (a short clip, whose every segment can
be recalled, costs each tidal head its whole audio at the peak), the least important tidal heads become fixed heads
for that sample (`triage.demote_tidal`, `n_demoted_tidal` in the knobs); anchors that alone exceed the target are
refused before any sample (`check`). The mean r_GPU is then under the target by the room the steps leave unused.

With `recall_budget: expected` lambda makes the expected r_GPU of §3.4 (the on-device audio share averaged over
decode steps) come within `lambda_tolerance` of the target instead (single steps then exceed it):
    expected r_GPU = prefill r_GPU (per-segment floors included)
                   + (R / n_seg) * sum over tidal heads of the positions their prefill selection misses,
divided by L * H_kv * n_audio. R is the expected number of segments the chunk swap holds recalled at a step
(`recall_budget: expected`; `none` targets the prefill footprint alone, as §2.2 literally states). R
follows from the swap's geometry and one constant (`triage.expected_resident_segments`): the recalled
set is the union of the last `delta` selections of top_k chunks of w = ceil(n_c / n_s) segments each, so
it holds between R_min = top_k + w - 1 segments (attention that stays on one run of adjacent chunks) and
R_max = delta * top_k * w (every step k new, disjoint chunks), both capped at the n_seg segments of the
sample, and equal to n_seg when top_k covers every chunk; R = R_min + mobility * (R_max - R_min). With
the paper's settings (n_c = 2 n_s, top_k = delta = 3) R_min = 4 and R_max = 18 segments: the recalled
count does not grow with the clip's length, so short and long clips get different recall shares, and
each tidal head is charged only for the positions it misses, so the charge shrinks as lambda grows. The
mobility (`method.mobility`, in [0, 1]) is how fast the anchors' attention moves between chunks; `auto`
takes the value wnw-calibrate measured on its calibration samples for the same swap settings
(`mobility.measure_swap_mobility`: the mean recalled count over decode steps mapped back through
the same formula), else `DEFAULT_MOBILITY` = 0.3 (the retired from-scratch tiny model measured 0.30 on its calibration
clips, whisper_smollm2 0.18; the random-weight tiny_random, whose attention wanders, 0.51). Not modelled: the
first delta - 1 steps (shorter window), where on the clip the recalled segments lie (every segment is taken as
equally likely), and how a given sample's attention moves: the mobility is a per-model mean, and single
samples scatter around it (six synthetic test clips: tiny_random 0.24-0.72, the retired tiny model 0.26-0.32;
six calibration clips: whisper_smollm2 0.15-0.20), so a run's r_GPU meets the target on average over samples, not each sample's. When even lambda = 0 expects
more than the target (the recall of a short clip on a model with few heads), the solver warns and runs
at lambda = 0.

Prefill (`place`): every non-anchor KV head ranks audio positions by the text-to-audio attention
summed over the prompt tokens after the audio and over its GQA group's query heads, and keeps the top
floor(retention * n_s) of each n_s-token segment (`selection: segment`) or one global top-k of the same
total (`selection: global`, ablation A2). Tidal heads move the rest to the CPU tier, fixed heads drop
it, anchors keep everything. A layer's heads are placed together: one stable sort selects for all of them
(`triage.select_masks`, the per-head `triage.select_positions` is its specification) and one `Placement` sets
their tiers (the store's `set_tiers_block`), so a layer costs a few launches and one host read (the store's check).

`head_scale: flat` replaces s~ by 1 for every non-anchor head (Eq. 1 without the importance), so a fixed
`lam` is every non-anchor head's share: `n_anchor = n_voice`, `head_scale: flat`, `lam: 0.05` keeps the voice
heads whole and a static 5% of every other head (a probe of the testbed, not a method). Beyond the paper,
`head_scale: spread` sizes each head's share by its importance times the fraction of audio positions that hold 90%
of its attention at a step (the head-score file's `audio_positions_90`, measured by wnw-calibrate): a head that reads
far from the focus keeps more in prefill, one that reads a few positions (which the chunk swap recalls) less;
`reading` uses the head's audio share of its attention in place of the importance (fixed heads that read much
audio then keep some). The roles stay the importance's.

`quota: floor` (§2.3) gives each segment floor(retention * n_s) positions, so a head with retention < 1/n_s
keeps none at all; `quota: spread` keeps the same fractional budget, floor(retention * n_audio) per head,
handing the remainders out over the segments (`triage.segment_quotas`). The lambda solver counts either
exactly.

The swap's first decision (`swap_start: prefill`, the default) is made from the anchors' attention of the
prompt's last row, the row that emits the first answer token, so the step that emits the second answer
token already sees the recalled chunks; `swap_start: decode` makes the first decision after decode step 0
(the step that emits the second token then sees the prefill subset alone). §2.3 does not say which; the
prompt's last row is the first answer token's attention, the first decode-time signal there is.

Decode: at each step the anchors' softmax weights at audio positions, summed over every anchor
(layer, query head) pair, give A_tau (Eq. 2), reset after the step. `after_step` scores each chunk by
the mean of A over its positions, selects the top `top_k` chunks, and runs the segment state machine,
shared by all tidal heads (they all follow the same anchor signal):
- a segment of a selected chunk that is not recalled is recalled: its CPU-tier positions are copied to
  the device for every tidal head (the host copy stays);
- a recalled segment that belongs to no selected chunk for `delta` consecutive steps is released: the
  positions it recalled leave the device again, so the segment returns to its prefill-selected subset.
  Prefill-selected positions are never released: they are the GPU-side starting point of each segment
  (§2.3: "a stable initial state for chunk swap"); only the recalled complement waxes and wanes.
`locality` (beyond the paper; 0, off, is the paper) chooses the other top_k - 1 chunks of a decision among those at
most `locality` chunks from the top one (`triage.ChunkSwap`), so a far chunk where the anchors put secondary
attention is not recalled in full (docs/diagnosis.md); the recall room and λ are unchanged.
The decisions made after step s take effect at step s + 1 (`lag: 1`, §2.3); `lag: 2`, the pipelined variant, puts
them in force one step later (an option of the benchmark, not of the paper).

`fixed_window` (beyond the paper; 0, off, is the paper): the fixed heads (retention < 1) move what their prefill
quota misses to the CPU tier instead of dropping it, and hold on the device the `fixed_window` segments centred on
the anchors' focus chunk (the swap's top chunk, `triage.window_segments`), moved with it after every decision
(recall the segments it enters, release those it leaves; no delta hysteresis). The peak lambda solve budgets
2 x `fixed_window` segments of each fixed head's host tier (the packed store releases the left window one step
late), so lambda falls, and the demotion of tidal heads on short clips counts a demoted head's window. Needs
`recall_budget: peak` and `lag: 1`. On a queuing store the window is decided on the device with the PyTorch
chunk swap (the one-launch Triton swap, `triton_swap`, has no window; `start` warns).

Where the chunk swap runs: on the reference store (the CPU) `triage.ChunkSwap` on the host, the specification;
on a store that queues its moves (the packed GPU store) `triage.DeviceChunkSwap`, the same rule on device
tensors: A, the chunk means, the top-k, the segment states and the recall/release masks never leave the device,
and the tidal heads' host-tier (row, position) pairs are handed to the store with the segment masks as a
fixed-shape `select`. The engine then flushes the store (the recalled rows are read from the pinned host mirror
by the GPU) before the next step, so the whole decision can be captured in the step's CUDA graph.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from typing import Any, Callable

import numpy as np
import torch

from wnw_exp.methods.wnw import triage
from wnw_exp.head_scores import HeadScores, resolve_head_scores
from wnw_exp.kv.base import HostRead, KVStore, to_device
from wnw_exp.kv.packed import queue_segments_stores
from wnw_exp.methods import register
from wnw_exp.methods.base import Placement, Policy, PrefillScores, SampleContext
from wnw_exp.methods.wnw.mobility import measure_swap_mobility

RECALL_BUDGETS = ("peak", "expected", "none")
SWAP_STARTS = ("prefill", "decode")
HEAD_SCALES = ("importance", "flat", "spread", "reading")
DEFAULT_MOBILITY = 0.3  # see the module docstring; wnw-calibrate measures it per model


class _Solutions(OrderedDict):
    """`WnW._solution`'s cache: the most recently used `size` keys. A policy's forks share it (`copy.deepcopy`, which
    `Policy.fork` makes, returns it itself)."""

    size = 32

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        while len(self) > self.size:
            self.popitem(last=False)

    def __deepcopy__(self, memo) -> "_Solutions":
        return self


@register
class WnW(Policy):
    name = "wnw"
    label, color, marker, role = "WnW (ours)", "tab:green", "o", "ours"  # how the report shows it

    @classmethod
    def calibrate(cls, scores: HeadScores, prompts: list[tuple[Any, float]], decode: Callable[..., Any],
                  backbone_info: dict, progress: bool = False) -> dict:
        """The swap mobility `mobility: auto` reads (`mobility.measure_swap_mobility`), at default settings."""
        policy = cls(scores=scores, mobility="auto", backbone_info=backbone_info)
        return {"swap_mobility": measure_swap_mobility(policy, prompts, decode, progress=progress)}
    graph_safe = True  # on a queuing store the chunk swap runs on the device (see the module docstring)
    cpu_tier = True

    def __init__(self, head_scores: str | None = None, n_voice: int | str = "auto", n_anchor: int | str = "auto",
                 lam: float | str = "auto", lambda_tolerance: float = 0.005, signal: str = "vs_hs",
                 selection: str = "segment", chunk_seconds: float = 4.0, stride_seconds: float = 2.0,
                 top_k: int = 3, delta: int = 3, recall_budget: str = "peak", mobility: float | str = "auto",
                 quota: str = "floor", swap_start: str = "prefill", head_scale: str = "importance", lag: int = 1,
                 fixed_window: int = 0, max_recalled: int = 0, locality: int = 0, backbone_info: dict | None = None,
                 scores=None):
        """`scores`: a HeadScores object (tests), instead of loading `head_scores`."""
        if lag not in (1, 2):
            raise ValueError(f"method.lag={lag!r}: 1 (a decision after step s is in force at s + 1) or 2 (pipelined)")
        self.lag = int(lag)
        self.scores = scores if scores is not None else resolve_head_scores(head_scores, backbone_info or {})
        if backbone_info:
            self.scores.check_matches(backbone_info)
        if signal not in triage.SIGNALS:
            raise ValueError(f"method.signal={signal!r}: choose one of {', '.join(triage.SIGNALS)}")
        if selection not in triage.SELECTIONS:
            raise ValueError(f"method.selection={selection!r}: choose one of {', '.join(triage.SELECTIONS)}")
        if quota not in triage.QUOTAS:
            raise ValueError(f"method.quota={quota!r}: choose one of {', '.join(triage.QUOTAS)}")
        if swap_start not in SWAP_STARTS:
            raise ValueError(f"method.swap_start={swap_start!r}: choose one of {', '.join(SWAP_STARTS)}")
        if head_scale not in HEAD_SCALES:
            raise ValueError(f"method.head_scale={head_scale!r}: choose one of {', '.join(HEAD_SCALES)}")
        self.quota, self.swap_start, self.head_scale = quota, swap_start, head_scale
        if top_k < 1 or delta < 1 or chunk_seconds <= 0 or stride_seconds <= 0:
            raise ValueError("method.top_k and method.delta must be >= 1, chunk and stride seconds > 0")
        if not (n_voice in (None, "auto", "all") or (isinstance(n_voice, int) and not isinstance(n_voice, bool))
                or (isinstance(n_voice, str) and n_voice.isdigit())):
            raise ValueError(f"method.n_voice={n_voice!r}: auto (§3.4), all (every KV head a voice head) or a "
                             "number of KV heads")
        self.n_voice_cfg, self.n_anchor_cfg, self.lam_cfg = n_voice, n_anchor, lam
        self.tolerance, self.signal, self.selection = float(lambda_tolerance), signal, selection
        self.chunk_seconds, self.stride_seconds = float(chunk_seconds), float(stride_seconds)
        self.top_k, self.delta = int(top_k), int(delta)
        if recall_budget not in RECALL_BUDGETS:
            raise ValueError(f"method.recall_budget={recall_budget!r}: choose one of {', '.join(RECALL_BUDGETS)}")
        if mobility not in (None, "auto") and not 0 <= float(mobility) <= 1:
            raise ValueError(f"method.mobility={mobility} must be auto or a number in [0, 1]")
        self.recall_budget, self.mobility_cfg = recall_budget, mobility
        if isinstance(fixed_window, bool) or not isinstance(fixed_window, int) or fixed_window < 0:
            raise ValueError(f"method.fixed_window={fixed_window!r}: a number of segments >= 0 (0: off) that the fixed "
                             "heads hold around the anchors' focus chunk")
        if fixed_window and (recall_budget != "peak" or self.lag != 1):
            raise ValueError(f"method.fixed_window={fixed_window} needs method.recall_budget=peak and method.lag=1 "
                             "(its room is budgeted per step)")
        self.fixed_window = fixed_window
        least = self.top_k * max(1, math.ceil(round(self.chunk_seconds / self.stride_seconds, 9)))
        if (isinstance(max_recalled, bool) or not isinstance(max_recalled, int) or max_recalled < 0
                or 0 < max_recalled < least):
            raise ValueError(f"method.max_recalled={max_recalled!r}: 0 (no cap, the paper) or a number of segments "
                             f">= {least} (one step's selection: top_k={self.top_k} chunks of "
                             f"{least // self.top_k} segments)")
        self.max_recalled = max_recalled
        self.locality = triage.check_locality(locality, self.top_k)  # refused before any sample
        self.token_rate = (backbone_info or {}).get("token_rate")
        self.importance = triage.importance(self.scores.voice_score, self.scores.head_sensitivity, signal)
        if head_scale in ("spread", "reading"):  # what sizes the shares (a file without it fails here, in one line)
            other = self._head_attention("audio") if head_scale == "reading" else self.importance
            self._reads = self._head_attention("audio_positions_90") * other
        self._triage_cache: dict[float, tuple] = {}
        self._solutions = _Solutions()  # `_solution`: per (sample length, target, ...), shared with the forks

    # --- triage (per retention target) -----------------------------------------------------------
    def triage_for(self, retention: float) -> tuple[np.ndarray, np.ndarray, int, int]:
        """(roles, s~, n_voice, n_anchor) for a target r_GPU."""
        if retention not in self._triage_cache:
            n = self.importance.size
            if self.n_voice_cfg in (None, "auto"):
                nv = triage.default_n_voice(retention, n)
            else:  # all: every KV head a voice head, so every non-anchor head follows the chunk swap
                nv = n if self.n_voice_cfg == "all" else int(self.n_voice_cfg)
            na = triage.default_n_anchor(retention, n) if self.n_anchor_cfg in (None, "auto") else int(self.n_anchor_cfg)
            if self.n_anchor_cfg in (None, "auto"):
                na = min(na, nv)
            roles = triage.assign_roles(self.importance, nv, na)
            if na == 0 and (roles == triage.TIDAL).any():
                raise triage.TriageError("tidal heads need at least one anchor head to drive the chunk swap: "
                                         "set method.n_anchor >= 1")
            s_tilde = triage.normalised_scores(self.importance, roles)
            if self.head_scale == "flat":  # every non-anchor head gets retention min(lambda, 1): lambda is the share
                s_tilde = np.where(roles == triage.ANCHOR, 1.0, np.ones_like(s_tilde))
            elif self.head_scale in ("spread", "reading"):  # the share of positions the head reads, times the
                s_tilde = triage.normalised_scores(self._reads, roles)  # importance (spread) or its audio share
            self._triage_cache[retention] = (roles, s_tilde, nv, na)
        return self._triage_cache[retention]

    def _head_attention(self, key: str) -> np.ndarray:
        """A per-KV-head measurement of the head-score file's calibration (`head_attention`, wnw-calibrate), as the
        importance's (L, H_kv) array."""
        got = (self.scores.calibration.get("head_attention") or {}).get(key)
        if got is None or np.asarray(got).shape != self.importance.shape:
            raise ValueError(f"method.head_scale={self.head_scale}: the head-score file ({self.scores.path}) has no "
                             f"per-head '{key}' of shape {self.importance.shape} in its calibration.head_attention: "
                             "re-run wnw-calibrate, or use head_scale=importance")
        return np.asarray(got, dtype=np.float64)

    def check(self, retention: float) -> None:
        roles = self.triage_for(retention)[0]  # n_voice / n_anchor against the model's heads
        n_anchor = int((roles == triage.ANCHOR).sum())
        if self.recall_budget == "peak" and n_anchor / roles.size > retention:  # anchors keep all their audio
            most = int(retention * roles.size + 1e-9)
            raise triage.TriageError(f"the {n_anchor} anchor heads alone keep r_GPU = {n_anchor / roles.size:.3f} of "
                                     f"the {roles.size} KV heads' audio on the device, above retention={retention}: "
                                     f"set method.n_anchor <= {most} or raise the retention")
        if self.token_rate:
            self._check_chunks(self.token_rate)

    def _check_chunks(self, token_rate: float) -> None:
        if min(self.chunk_seconds, self.stride_seconds) * token_rate < 1:
            raise ValueError(f"method.chunk_seconds={self.chunk_seconds} / stride_seconds={self.stride_seconds} is "
                             f"shorter than one audio token ({1 / token_rate:.3f} s at {token_rate:g} "
                             "tokens/s): use chunks of at least one token")

    # --- per sample -------------------------------------------------------------------------------
    def host_mirror(self, ctx: SampleContext) -> bool | np.ndarray:
        """Only the rows that `place` offloads (tidal heads, and with `fixed_window` fixed heads, at retention < 1)
        ever reach the host tier."""
        if (ctx.n_layers, ctx.n_kv_heads) != self.importance.shape:
            return True  # (`start` names the mismatch)
        sol = self._solution(ctx)
        return np.flatnonzero((((sol["roles"] == triage.TIDAL) & (sol["retention"] < 1.0)) | sol["window"]).ravel())

    def start(self, ctx: SampleContext, store: KVStore) -> None:
        super().start(ctx, store)
        if (ctx.n_layers, ctx.n_kv_heads) != self.importance.shape:
            raise ValueError(f"head scores are for {self.importance.shape} (layers, KV heads), the model has "
                             f"{(ctx.n_layers, ctx.n_kv_heads)}")
        self._check_chunks(ctx.token_rate)
        vars(self).update(self._solution(ctx))
        n_a = ctx.n_audio
        self.swap = triage.ChunkSwap(n_a, self.n_s, self.n_c, self.top_k, self.delta, self.max_recalled,
                                     self.locality)
        self.scores_acc = torch.zeros(n_a, device=ctx.device)
        self._offloaded: dict[tuple[int, int], torch.Tensor] = {}  # tidal head -> its host-tier positions (sorted)
        self._unread: list[tuple[int, list[int], torch.Tensor]] = []  # placed layers whose masks `offloaded` reads
        # the host tiers read so far, in placement order, as arrays: (rows l * H_kv + h, counts, positions) per read
        self._tier_parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._tier: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # their concatenation
        self._host_index: dict[bool, tuple] = {}  # (window?) -> by-position host-tier index, built at the first move
        self._held: tuple = ([], [])  # lag 2: the decision waiting one step
        self._trace = dict(selected_chunks=[], recalled_segments=[], released_segments=[], recalled_fraction=[],
                           resident_segments=[])
        self._window_rows = {(int(li), int(k)) for li, k in zip(*np.nonzero(self.window))}
        self._window_row_ids = np.flatnonzero(self.window.ravel())  # (the same, as rows l * H_kv + h)
        self._window_at: list[int] = []  # `fixed_window`: the segments the fixed heads hold now (host swap)
        self.windowed = bool(self._window_rows) and self.has_anchors and bool(self.swap.chunks)
        if self.windowed:
            self._window_table = triage.window_segments(self.swap.chunk_segments, len(self.swap.segments),
                                                        self.fixed_window)
            self._trace["window_segments"] = []
        self.on_device = bool(store.queues_moves) and self.has_anchors and bool(self.swap.chunks)
        if self.on_device:
            dev, n_steps = ctx.device, store.dense_capacity + 2  # every decision of the sample (prefill's included)
            self.device_swap = triage.DeviceChunkSwap(n_a, self.n_s, self.n_c, self.top_k, self.delta, dev,
                                                      self.max_recalled, self.locality)
            n_seg, n_ch = self.device_swap.n_seg, self.device_swap.n_chunks
            self._t = torch.zeros((), dtype=torch.long, device=dev)  # decisions made so far
            self._rec = dict(selected=torch.zeros(n_steps, n_ch, dtype=torch.bool, device=dev),
                             recall=torch.zeros(n_steps, n_seg, dtype=torch.bool, device=dev),
                             release=torch.zeros(n_steps, n_seg, dtype=torch.bool, device=dev),
                             resident=torch.zeros(n_steps, dtype=torch.long, device=dev))
            self._held_masks = (torch.zeros(n_seg, dtype=torch.bool, device=dev),
                                torch.zeros(n_seg, dtype=torch.bool, device=dev))
            self._pairs: tuple[torch.Tensor, ...] | None = None  # built at the first chunk swap
            self._fused_swap = None  # with the store's Triton kernels: the decision and its records in one launch
            if self.windowed:
                self._window_pairs: tuple[torch.Tensor, ...] | None = None  # built at the first chunk swap
                self._window_mask = torch.zeros(n_seg, dtype=torch.bool, device=dev)
                self._window_dev = torch.as_tensor(self._window_table, device=dev)
                self._rec["window"] = torch.zeros(n_steps, n_seg, dtype=torch.bool, device=dev)
                if store.kernels == "triton":
                    warnings.warn("WnW: method.fixed_window runs the chunk swap with the PyTorch kernels (the "
                                  "one-launch Triton swap has no window)", stacklevel=2)
            elif store.kernels == "triton":
                from wnw_exp.methods.wnw.triton_swap import FusedChunkSwap

                self._fused_swap = FusedChunkSwap(self.device_swap, self._rec, self._t, self.n_s, self.n_c,
                                                  self.top_k, self.delta)

    def _solution(self, ctx: SampleContext) -> dict:
        """`start`'s attributes that follow from the sample's length, target, token rate and GQA group and from the
        policy's settings alone (triage, lambda, the r_GPU figures, the anchors' query heads; `_solve`): made once per
        such key and shared, read-only, by the policy and its forks (`_Solutions`), so the streams of a batch with
        the same audio length pay for them once."""
        mobility = self._mobility()
        key = (ctx.n_audio, ctx.retention, ctx.token_rate, ctx.group, mobility, self.importance.tobytes(),
               self.n_voice_cfg, self.n_anchor_cfg, self.lam_cfg, self.tolerance, self.signal, self.selection,
               self.chunk_seconds, self.stride_seconds, self.top_k, self.delta, self.recall_budget, self.quota,
               self.head_scale, self.fixed_window, self.max_recalled)
        solution = self._solutions.get(key)
        if solution is None:
            solution = self._solutions[key] = self._solve(ctx, *mobility)
        self._solutions.move_to_end(key)
        return solution

    def _solve(self, ctx: SampleContext, mobility: float, mobility_source: str) -> dict:
        """Triage and lambda for one sample length and target (see the module docstring): the attributes `start`
        sets from them, and an empty `_plans` for `_placement`."""
        roles, s_tilde, n_voice, n_anchor = self.triage_for(ctx.retention)
        n_c, n_s = triage.swap_sizes(ctx.token_rate, self.chunk_seconds, self.stride_seconds)
        # Segments a tidal head may hold recalled at once (see `recall_headroom`).
        peak_segments = triage.peak_recalled_segments(ctx.n_audio, n_s, n_c, self.top_k, self.delta, self.max_recalled)
        n_a = ctx.n_audio
        # `fixed_window`: a fixed head holds its window's segments, and on a store that releases lazily the window it
        # left for one more step: room for twice the window (capped at the segment count)
        window_room = min(math.ceil(n_a / n_s), 2 * self.fixed_window) if n_a else 0
        if self.recall_budget == "peak" and self.lam_cfg in (None, "auto"):
            # the tidal heads' recall room must fit beside the anchors even at lambda = 0 (short clips, low targets)
            roles = triage.demote_tidal(self.importance, roles, n_a, n_s, peak_segments, ctx.retention,
                                        self.selection, self.quota, window_room)
        n_demoted = int((self.triage_for(ctx.retention)[0] == triage.TIDAL).sum() - (roles == triage.TIDAL).sum())
        if self.recall_budget != "none":
            expected_resident = triage.expected_resident_segments(n_a, n_s, n_c, self.top_k, self.delta, mobility,
                                                                  self.max_recalled)
        else:
            expected_resident = 0.0
        n_seg = math.ceil(n_a / n_s) if n_a else 1
        resident_fraction = expected_resident / n_seg
        if self.lam_cfg not in (None, "auto"):
            lam = float(self.lam_cfg)
        elif self.recall_budget == "peak":
            lam = triage.solve_peak_lambda(s_tilde, roles, n_a, n_s, ctx.retention, peak_segments, self.selection,
                                           self.quota, window_segments=window_room).lam
        else:
            lam = triage.solve_lambda(s_tilde, roles, n_a, n_s, ctx.retention, self.tolerance,
                                      resident_fraction=resident_fraction, quota=self.quota).lam
        retention = triage.retentions(s_tilde, roles, lam)
        window = (roles == triage.FIXED) & (retention < 1.0) & (self.fixed_window > 0)  # the heads with a window
        g = ctx.group
        anchor_q = {li: [int(k) * g + j for k in np.flatnonzero(roles[li] == triage.ANCHOR) for j in range(g)]
                    for li in range(ctx.n_layers)}
        for x in (roles, retention, window):
            x.flags.writeable = False  # shared by every stream of this key
        return dict(n_voice=n_voice, n_anchor=n_anchor, n_c=n_c, n_s=n_s, peak_segments=peak_segments, roles=roles,
                    window=window, window_room=window_room,
                    n_demoted=n_demoted, mobility=mobility, mobility_source=mobility_source,
                    expected_resident=expected_resident, lam=lam, retention=retention,
                    prefill_r_gpu=triage.prefill_r_gpu(retention, roles, n_a, n_s, self.quota),
                    expected_r_gpu=triage.expected_r_gpu(retention, roles, n_a, n_s, resident_fraction, self.quota),
                    peak_r_gpu=triage.peak_r_gpu(retention, roles, n_a, n_s, peak_segments, self.selection,
                                                 self.quota, window_room),
                    anchor_q=anchor_q, has_anchors=any(anchor_q.values()),
                    tidal=[(int(li), int(k)) for li, k in zip(*np.nonzero(roles == triage.TIDAL))], _plans={})

    @property
    def recall_headroom(self) -> np.ndarray:
        """Device rows each (layer, KV head) = row l * H_kv + h may gain beyond its prefill selection, (L * H_kv,):
        for a tidal head, the sum of its `peak_segments` largest per-segment host-tier counts (the most the
        chunk swap can have recalled on it at once, `triage.peak_recalled_segments`: delta + 1 selections of
        top_k chunks, as the packed store releases lazily), which is at most all its host-tier positions; 0
        for every other head. Exact for any selection (segment or global). The packed store raises if a
        recall would ever exceed it. Read after `place` has run on every layer."""
        room = np.zeros(self.ctx.n_layers * self.ctx.n_kv_heads, np.int64)
        for window, segments in ((False, self.peak_segments), (True, self.window_room)):
            rows, counts, pos = self._host_tier(window)
            n_seg, m = len(self.swap.segments), len(rows)
            per_seg = np.bincount(np.repeat(np.arange(m), counts) * n_seg + pos // self.n_s, minlength=m * n_seg)
            room[rows] = np.sort(per_seg.reshape(m, n_seg), axis=1)[:, ::-1][:, :segments].sum(axis=1)
        return room

    def _mobility(self) -> tuple[float, str]:
        """The anchor attention's mobility between chunks (see the module docstring) and where it came from.

        A number in the config wins; auto takes the head-score file's measurement
        (`calibration.swap_mobility`, made by wnw-calibrate) when it was made with the same triage signal and
        chunk swap settings, else DEFAULT_MOBILITY.
        """
        if self.mobility_cfg not in (None, "auto"):
            return float(self.mobility_cfg), "config"
        measured = self.scores.calibration.get("swap_mobility") or {}
        same = (measured.get("signal") == self.signal and measured.get("top_k") == self.top_k
                and measured.get("delta") == self.delta
                and math.isclose(measured.get("chunk_seconds", -1), self.chunk_seconds)
                and math.isclose(measured.get("stride_seconds", -1), self.stride_seconds))
        value = measured.get("value") if same else None
        return (float(value), "calibration") if value is not None else (DEFAULT_MOBILITY, "default")

    def observe_heads(self, layer: int) -> list[int]:
        return self.anchor_q.get(layer, [])

    def place(self, layer: int, scores: PrefillScores) -> Placement | None:
        """Prefill selection of one layer (`place_all` of that layer): every placed head (non-anchor, retention < 1)
        at once, one mask per head from one stable sort (`triage.select_masks`), in one placement (tidal heads
        offload the rest, fixed heads drop it). No host read here; the tidal heads' host-tier positions are read
        back when `offloaded` is first read."""
        got = self.place_all([(layer, scores)])
        return got[0][1] if got else None

    def place_all(self, scored: list[tuple[int, PrefillScores]]) -> list[tuple[int, Placement]]:
        """The placement of every held layer (the engine's deferred placement holds them all): each layer's head
        scores (its rows after the audio, summed over the query heads of each KV head) and, with swap_start=prefill,
        its anchors' attention of the prompt's last row added to the anchor signal (Eq. (2)); then the selections of
        every placed head of every layer in one stable sort (each row sorted on its own: the masks one layer at a
        time would give)."""
        if not scored:
            return []
        H, g = self.ctx.n_kv_heads, self.ctx.group
        plan = self._placement(scored[0][1].post_audio.shape[-1])
        layers, per_head = [], []
        for layer, scores in scored:
            post = scores.post_audio
            if self.swap_start == "prefill" and self.anchor_q.get(layer):
                last = scores.last_window[:, -1] if scores.last_window is not None else post[:, -1]
                a0, a1 = plan["anchor_at"][layer], plan["anchor_at"][layer + 1]
                self.scores_acc += last.index_select(0, plan["anchor_q"][a0:a1]).float().sum(dim=0)
            if plan["placed_host"][layer].any():
                layers.append(layer)
                per_head.append(post.float().sum(dim=1).view(H, g, -1).sum(dim=1))  # (H_kv, n_audio)
        if not layers:
            return []
        at = self._to_device(np.asarray(layers, np.int64)) if len(layers) < self.ctx.n_layers else None
        quotas, placed, tidal = (plan[k] if at is None else plan[k].index_select(0, at)
                                 for k in ("quotas", "placed", "tidal"))
        n_a = per_head[0].shape[-1]
        keep = triage.select_masks(torch.stack(per_head).view(-1, n_a), quotas.reshape(len(layers) * H, -1),
                                   plan["block"]).view(len(layers), H, n_a)
        offload = ~keep & tidal[..., None]
        out = []
        for i, layer in enumerate(layers):
            tidal_heads = plan["tidal_heads"][layer]
            if tidal_heads:
                self._unread.append((layer, tidal_heads, keep[i]))
            out.append((layer, Placement(keep[i], offload[i] if tidal_heads else None, select=placed[i])))
        return out

    def _placement(self, n_a: int) -> dict:
        """What `place` needs for every layer: each (layer, KV head)'s per-block quotas (`triage.block_quotas`), which
        heads are placed (non-anchor, retention < 1) and which of those are tidal, and every layer's anchor query heads
        (`anchor_q[anchor_at[l]:anchor_at[l + 1]]`), on the device (copied from pinned memory on CUDA: no host read);
        each layer's placed tidal heads on the host. Made once per audio length and device for every stream of the
        same `_solution` (read-only)."""
        key = (n_a, str(self.ctx.device))
        plan = self._plans.get(key)
        if plan is None:
            quotas, block = triage.block_quotas(self.retention, n_a, self.n_s, self.selection, self.quota)
            placed = (self.roles != triage.ANCHOR) & (self.retention < 1.0)
            tidal = placed & ((self.roles == triage.TIDAL) | self.window)  # the heads that offload (a window's too)
            table = self._to_device(np.concatenate([quotas, placed[..., None], tidal[..., None]], axis=-1))
            layers = range(self.ctx.n_layers)
            anchor_q = np.array([q for li in layers for q in self.anchor_q[li]], np.int64)
            plan = self._plans[key] = dict(
                block=block, quotas=table[..., :-2], placed=table[..., -2] > 0, tidal=table[..., -1] > 0,
                placed_host=placed, tidal_heads=[np.flatnonzero(t).tolist() for t in tidal],
                anchor_q=self._to_device(anchor_q),
                anchor_at=np.cumsum([0] + [len(self.anchor_q[li]) for li in layers]).tolist())
        return plan

    def _to_device(self, x: np.ndarray) -> torch.Tensor:
        """A host array on the sample's device, with no host wait (`kv.base.to_device`)."""
        return to_device(x, torch.device(self.ctx.device))

    @property
    def offloaded(self) -> dict[tuple[int, int], torch.Tensor]:
        """Tidal head (layer, KV head) -> its host-tier positions, a sorted CPU long tensor, in placement order. The
        masks of the layers placed since the last read are read from the device (`_read_tiers`, one copy)."""
        self._read_tiers()
        n_read = sum(len(rows) for rows, _, _ in self._tier_parts)
        if len(self._offloaded) < n_read:  # the heads read since the dict was last made
            H = self.ctx.n_kv_heads
            rows, counts, pos = self._host_tiers()
            new = slice(len(self._offloaded), n_read)
            ends = np.cumsum(counts)
            for r, e, c in zip(rows[new].tolist(), ends[new].tolist(), counts[new].tolist()):
                self._offloaded[(r // H, r % H)] = torch.from_numpy(pos[e - c:e])
        return self._offloaded

    def _read_tiers(self) -> None:
        """The host tiers of the tidal heads of the layers placed since the last read: their masks read from the
        device in one copy, kept as arrays (`_host_tiers`)."""
        if not self._unread:
            return
        masks = torch.stack([keep for _, _, keep in self._unread]).cpu().numpy()  # (layers, H_kv, n_audio)
        H, n = masks.shape[1:]
        at = np.array([i * H + k for i, (_, heads, _) in enumerate(self._unread) for k in heads], np.int64)
        rows = np.array([layer * H + k for layer, heads, _ in self._unread for k in heads], np.int64)
        which, pos = np.nonzero(~masks.reshape(-1, n)[at])  # the tidal heads' host tiers, in placement order
        self._tier_parts.append((rows, np.bincount(which, minlength=len(at)).astype(np.int64), pos.astype(np.int64)))
        self._tier = None
        self._unread = []

    def _host_tiers(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every head's host tier read so far: rows (l * H_kv + h), counts and positions (each head's ascending),
        in placement order."""
        if self._tier is None:
            parts = self._tier_parts or [(np.zeros(0, np.int64),) * 3]
            self._tier = tuple(np.concatenate(x) for x in zip(*parts))
        return self._tier

    def _host_tier(self, window: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The tidal heads' host tiers (with `window`: the fixed heads' of `fixed_window` instead) as arrays: each
        head's row (l * H_kv + h) and host-tier count, and every position."""
        self._read_tiers()
        rows, counts, pos = self._host_tiers()
        if not len(self._window_row_ids):
            return (rows, counts, pos) if not window else (rows[:0], counts[:0], pos[:0])
        sel = np.isin(rows, self._window_row_ids) == window
        return rows[sel], counts[sel], pos[np.repeat(sel, counts)]

    def observe(self, layer: int, probs: torch.Tensor) -> None:
        self.scores_acc += probs.sum(dim=0)

    def observe_sum(self, layer: int) -> torch.Tensor | None:
        # the anchor signal is the sum of the observer heads' weights: the fused steps may add it in directly
        return self.scores_acc if self.on_device else None

    def after_prefill(self) -> None:
        if self.swap_start == "prefill":
            self.after_step(-1)  # the first decision, from the prompt's last row, in force at decode step 0

    def after_step(self, step: int | None) -> None:
        self._adjust_signal(step)
        self._decide(step)

    def _adjust_signal(self, step: int | None) -> None:
        """Before each decision (`after_step`, or a batch's `after_step_all`): a subclass's change to the accumulated
        anchor signal `scores_acc` (graph-safe; the benchmarks' scripted anchor attention,
        `benchmarks/decode_speed.py: scripted_wnw`). None here."""

    # whether `_adjust_signals` of a subclass finds each policy's tensors through tables in `held` (rewritten in
    # place where held has a "capacity"): a graph captured over its batch may then replay for other streams
    tabled_signals = False

    @classmethod
    def _adjust_signals(cls, together: list[tuple["WnW", int | None]], held: dict | None = None) -> None:
        """`_adjust_signal` of the policies that decide together in a batch ((policy, step) pairs): each its own
        here; a subclass may do them in fewer launches (`held`: the batch's dict, as `after_step_all`'s)."""
        for p, i in together:
            p._adjust_signal(i)

    def _decide(self, step: int | None) -> None:
        if not self.has_anchors:
            return
        if self.on_device:
            self._after_step_device()
            return
        selected, recall, release = self.swap.step(self.scores_acc)
        self.scores_acc.zero_()  # A^(s) reflects only the current step
        moves = (recall, release)
        if self.lag == 2:
            moves, self._held = self._held, moves
        self._move(moves[0], recall=True)
        self._move(moves[1], recall=False)
        if self.windowed:  # the fixed heads' window follows the anchors' focus chunk, no hysteresis
            now = np.flatnonzero(self._window_table[self.swap.focus]).tolist()
            self._move(sorted(set(now) - set(self._window_at)), recall=True, window=True)
            self._move(sorted(set(self._window_at) - set(now)), recall=False, window=True)
            self._window_at = now
            self._trace["window_segments"].append(now)
        self._trace["selected_chunks"].append(selected)
        self._trace["recalled_segments"].append(recall)
        self._trace["released_segments"].append(release)
        self._trace["recalled_fraction"].append(self.swap.recalled_fraction)
        self._trace["resident_segments"].append(int(self.swap.recalled.sum()))

    def _after_step_device(self) -> None:
        """`after_step` on the device (graph-safe): decide, record the decision, queue the tidal heads' moves."""
        fused = None
        if self._fused_swap is not None:  # the same decision, records, counter and score reset, in one launch
            try:
                fused = self._fused_swap(self.scores_acc)
            except Exception as e:  # noqa: BLE001 - a kernel this GPU cannot compile (the first call is eager)
                warnings.warn(f"WnW: the one-launch chunk swap failed ({type(e).__name__}: {str(e)[:200]}); "
                              "deciding with the PyTorch kernels instead", stacklevel=2)
                self._fused_swap = None
        if fused is not None:
            selected, recall, release = fused
        else:
            selected, recall, release = self.device_swap.step(self.scores_acc)
            self.scores_acc.zero_()
            t = self._t.view(1)
            records = [("selected", selected), ("recall", recall), ("release", release),
                       ("resident", self.device_swap.recalled.sum())]
            if self.windowed:  # the fixed heads' window follows the anchors' focus chunk (as on the host)
                now = self._window_dev[self.device_swap.top[0]]
                self._queue(now & ~self._window_mask, self._window_mask & ~now, window=True)
                self._window_mask.copy_(now)
                records.append(("window", now))
            for name, x in records:
                self._rec[name].index_copy_(0, t, x.view(1, *x.shape))
            self._t += 1
        if self.lag == 2:  # queue the previous decision, keep this one for the next step
            held_rec, held_rel = self._held_masks
            (recall, release), now = (held_rec.clone(), held_rel.clone()), (recall, release)
            held_rec.copy_(now[0])
            held_rel.copy_(now[1])
        self._queue(recall, release)

    def _host_pairs(self, window: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every tidal head's host-tier (row, position) pairs and their segments, int64 device tensors (made at the
        first chunk swap, an eager one); with `window` the fixed heads' of `fixed_window`."""
        if (self._window_pairs if window else self._pairs) is None:
            rows, counts, pos = self._host_tier(window)
            pos = self._to_device(pos)  # (from pinned memory: no wait for the device)
            pairs = self._to_device(np.repeat(rows, counts)), pos, pos // self.n_s
            if window:
                self._window_pairs = pairs
            else:
                self._pairs = pairs
        return self._window_pairs if window else self._pairs

    def _queue(self, recall: torch.Tensor, release: torch.Tensor, window: bool = False) -> None:
        rows, pos, seg = self._host_pairs(window)
        if len(pos):  # both queues, chosen per segment (one launch inside a capture)
            self.store.queue_segments(rows, pos, seg, recall, release)

    @staticmethod
    def _joins(p: "WnW") -> bool:
        """Whether `p` decides and queues with a batch's one-launch tables (on the device, the store's Triton
        kernels and moves, lag 1); the others step on their own."""
        return (p.has_anchors and p.on_device and p._fused_swap is not None and p.lag == 1
                and p.store.moves == "triton")

    @staticmethod
    def _swap_tables(together: list["WnW"], held: dict):
        """The batch's `ChunkSwapTables` (kept in `held`, rebuilt when a tensor in them changes: outside a
        capture)."""
        from wnw_exp.methods.wnw.triton_swap import ChunkSwapTables

        parts = [(p._fused_swap, p.scores_acc) for p in together]
        tables = held.get("swap_tables")
        if tables is None or tables.key != ChunkSwapTables.key_of(parts):
            if tables is None or tables.capacity is None or not tables.bind(parts):
                tables = held["swap_tables"] = ChunkSwapTables(parts, together[0].ctx.device, held.get("capacity"))
        return tables

    @staticmethod
    def _queue_held(held: dict) -> dict:
        """The stores' queue tables' dict in the batch's `held` (with its capacity, if any)."""
        return held.setdefault("queue_tables", {"capacity": held.get("capacity")})

    @staticmethod
    def _queue_parts(together: list["WnW"]) -> list:
        """What the stores queue from the batch's decisions: (store, its tidal heads' host-tier pairs, the recall
        and release masks the decision wrote) per policy."""
        return [(p.store, p._host_pairs(), p._fused_swap.recall, p._fused_swap.release) for p in together]

    @classmethod
    def after_step_all(cls, policies: list["WnW"], steps: list, held: dict) -> None:
        """A batch's `after_step`s: the policies deciding in one Triton launch on their own (`_joins`) decide
        together in one launch (`triton_swap.ChunkSwapTables`) and their stores queue the moves the decisions ask
        for together in a second (`kv.packed.queue_segments_stores`), eagerly as inside a capture: the moves a
        captured step queues, without the eager store's per-stream checks and their host reads, several per stream,
        which made a batch's eager steps slow. The others step on their own. Each policy's state, records and
        queued moves are what its own `after_step` makes."""
        joins = [cls._joins(p) for p in policies]
        for p, i, j in zip(policies, steps, joins):
            if not j:
                p.after_step(i)
        together = [(p, i) for p, i, j in zip(policies, steps, joins) if j]
        if not together:
            return
        cls._adjust_signals(together, held)
        try:
            tables = cls._swap_tables([p for p, _ in together], held)
            tables.decide()
        except Exception as e:  # noqa: BLE001 - a kernel this GPU cannot compile (the first call is eager)
            warnings.warn(f"WnW: the one-launch chunk swap failed ({type(e).__name__}: {str(e)[:200]}); "
                          "deciding with the PyTorch kernels instead", stacklevel=2)
            held.pop("swap_tables", None)
            for p, i in together:
                p._fused_swap = None
                p._decide(i)  # its signal is adjusted already
            return
        queue_segments_stores(cls._queue_parts([p for p, _ in together]), cls._queue_held(held))

    @classmethod
    def graph_reusable(cls, policies: list["WnW"]) -> bool:
        """Every policy decides and queues with the batch's one-launch tables (`_joins`), which are rewritten in
        place for another set of streams, and its signal adjustment launches nothing per stream (or a subclass's
        does it through tables, `tabled_signals`)."""
        plain = (cls._adjust_signal is WnW._adjust_signal
                 and cls._adjust_signals.__func__ is WnW._adjust_signals.__func__)
        return (plain or cls.tabled_signals) and all(cls._joins(p) for p in policies)

    @classmethod
    def prepare_step_all(cls, policies: list["WnW"], held: dict) -> None:
        """The batch's `ChunkSwapTables` and its stores' queue tables (with each joining policy's host-tier pairs),
        built before a capture."""
        together = [p for p in policies if cls._joins(p)]
        if together:
            cls._swap_tables(together, held)
            queue_segments_stores(cls._queue_parts(together), cls._queue_held(held), launch=False)

    def _move(self, segs: list[int], recall: bool, window: bool = False) -> None:
        """Recall or release segments `segs`' host-tier positions on every tidal head (with `window`: every fixed
        head of `fixed_window`), in one store call (the segments are disjoint, so one call queues exactly what one
        call per segment, in order, would)."""
        if not segs:
            return
        if window not in self._host_index:  # (rows, positions) of the heads' host tiers, by position
            rows, counts, pos = self._host_tier(window)
            rows = np.repeat(rows, counts)
            order = np.argsort(pos, kind="stable")
            starts = np.array([b for b, _ in self.swap.segments] + [self.ctx.n_audio], np.int64)
            self._host_index[window] = rows[order], pos[order], np.searchsorted(pos[order], starts)
        rows, pos, seg_at = self._host_index[window]
        lo, hi = seg_at[segs], seg_at[np.asarray(segs) + 1]
        if len(segs) == 1 or (lo[1:] == hi[:-1]).all():  # adjacent segments: one slice
            sl = slice(lo[0], hi[-1])
            r, p = rows[sl], pos[sl]
        else:
            idx = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)])
            r, p = rows[idx], pos[idx]
        if len(p):
            (self.store.recall if recall else self.store.release)(r, p)

    # --- records ------------------------------------------------------------------------------------
    def knobs(self) -> dict:
        return dict(lam=self.lam, prefill_r_gpu=self.prefill_r_gpu, expected_r_gpu=self.expected_r_gpu,
                    peak_r_gpu=self.peak_r_gpu, n_demoted_tidal=self.n_demoted,
                    recall_budget=self.recall_budget, expected_resident_segments=self.expected_resident,
                    mobility=self.mobility, mobility_source=self.mobility_source, n_voice=self.n_voice, n_anchor=self.n_anchor,
                    n_tidal=len(self.tidal), signal=self.signal, selection=self.selection, n_s=self.n_s,
                    n_c=self.n_c, top_k=self.top_k, delta=self.delta, quota=self.quota, swap_start=self.swap_start,
                    head_scale=self.head_scale,
                    head_scores=self.scores.path, **({"lag": self.lag} if self.lag != 1 else {}),
                    **({"fixed_window": self.fixed_window, "n_window": int(self.window.sum())}
                       if self.fixed_window else {}),
                    **({"max_recalled": self.max_recalled} if self.max_recalled else {}),
                    **({"locality": self.locality} if self.locality else {}))

    def read_records(self):
        return HostRead(self._t, *self._rec.values()) if self.on_device else None

    def trace(self, read=None) -> dict:
        if self.on_device:  # the decisions recorded on the device, as the host swap lists them
            n, *recs = (read or self.read_records()).get()  # (one host read)
            rec = {k: r[: int(n)] for k, r in zip(self._rec, recs)}
            lists = _row_lists
            resident = rec["resident"].tolist()
            n_seg = self.device_swap.n_seg
            self._trace = dict(selected_chunks=lists(rec["selected"]), recalled_segments=lists(rec["recall"]),
                               released_segments=lists(rec["release"]),
                               recalled_fraction=[r / n_seg if n_seg else 0.0 for r in resident],
                               resident_segments=resident)
            if "window" in rec:
                self._trace["window_segments"] = lists(rec["window"])
        return dict(wnw=self._trace, roles=self.roles.tolist(), retention=np.round(self.retention, 6).tolist())


def _row_lists(m: torch.Tensor) -> list[list[int]]:
    """Each row's nonzero columns (a (steps, n) mask), in one pass (a row at a time costs ~10 us a row)."""
    rows, cols = np.nonzero(m.numpy())
    out: list[list[int]] = [[] for _ in range(m.shape[0])]
    for r, c in zip(rows.tolist(), cols.tolist()):
        out[r].append(c)
    return out
