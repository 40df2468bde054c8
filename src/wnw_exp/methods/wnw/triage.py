"""Head triage and prefill retention (§2.2, §2.3), as pure functions.

Everything here works on per-(layer, KV head) arrays of shape (L, H_kv) and on one head's audio
positions; nothing touches a model or the KV store, so each rule can be tested on hand-made numbers.

- `importance`: the ranking signal, VS x HS (WnW), VS only or HS only (ablation A3).
- `assign_roles`: top `n_voice` heads are voice heads, the top `n_anchor` of those anchors, the other
  voice heads tidal, every other head fixed (ties broken by head index, layer-major).
- `normalised_scores`: s~_i = score_i / max(score over non-anchor heads), so the best non-anchor head
  has s~ = 1 and every s~ is in [0, 1] (anchors are pinned to 1; they keep everything anyway).
- `retentions`: Eq. (1), retention_i = min(s~_i * lambda, 1); anchors 1.
- `prefill_r_gpu`: the on-device audio fraction right after prefill, counted exactly as the per-segment
  selection keeps it (sum over segments of floor(retention * segment length); the last segment may be
  shorter than n_s and is floored on its own length); `kept_per_head` is one head's count, `kept_counts` every head's
  at once (the solvers evaluate all heads per lambda).
- `resident_segment_bounds` / `expected_resident_segments`: how many segments the decode-time chunk swap
  holds recalled at a step, from the swap's geometry (top-k chunks, delta, chunk overlap, segment count)
  and one constant, the anchor attention's mobility; `expected_r_gpu` adds the tidal heads' recalled
  positions to the prefill footprint, and `solve_lambda` finds lambda by bisection so that the sum
  matches the target. `peak_recalled_segments`: the most a head can hold at once on a store with lazy
  releases (sizes the packed store's recall room).
- `select_positions`: per-segment top-floor(retention * n_s) (default) or one global top-k with the same
  total (ablation A2). `quota="spread"` keeps the same fractional budget but hands the remainders out
  over the segments (segment [a, b) keeps floor(ret * b) - floor(ret * a)), so a head with
  retention < 1 / n_s still keeps floor(ret * n_audio) positions instead of none.
- `block_quotas` / `select_masks`: the same selection for many heads at once (WnW's prefill places a layer's heads
  in one go): the per-block counts of every head on the host, the masks on the device from one stable sort.
- `segment_bounds` / `chunk_bounds`: the segment and chunk grid of §2.3.
- `ChunkSwap`: the decode-time chunk selection and segment state machine on host arrays (the specification);
  `DeviceChunkSwap` the same on device tensors, updated in place, so that a CUDA graph can hold it.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from wnw_exp.kv.base import to_device
from wnw_exp.methods.scoring import top_masks

ANCHOR, TIDAL, FIXED = "anchor", "tidal", "fixed"
SIGNALS = ("vs_hs", "vs", "hs")
SELECTIONS = ("segment", "global")
QUOTAS = ("floor", "spread")

# §3.4: n_voice per target r_GPU. Voxtral (240 KV heads) 90/50/30/30 and Qwen2.5-Omni (72) 27/15/9/9
# are the same fractions of the model's KV heads, so one table serves every model.
N_VOICE_FRACTION = {0.2: 90 / 240, 0.4: 50 / 240, 0.6: 30 / 240, 0.8: 30 / 240}
PAPER_N_ANCHOR = 5
DEFAULT_SWAP = dict(chunk_seconds=4.0, stride_seconds=2.0, top_k=3, delta=3)  # §2.3
_EPS = 1e-9  # floor(ret * n) must not lose a token to rounding (0.2 * 25 = 4.999...)


class TriageError(ValueError):
    """A triage setting that cannot be realised (e.g. anchors alone exceed the target budget)."""


def importance(voice_score: np.ndarray, head_sensitivity: np.ndarray, signal: str = "vs_hs") -> np.ndarray:
    """The triage signal per KV head: VS x HS (WnW), VS only or HS only (ablation A3)."""
    vs, hs = np.asarray(voice_score, dtype=np.float64), np.asarray(head_sensitivity, dtype=np.float64)
    if signal == "vs_hs":
        return vs * hs
    if signal == "vs":
        return vs.copy()
    if signal == "hs":
        return hs.copy()
    raise ValueError(f"unknown triage signal {signal!r}; choose one of {', '.join(SIGNALS)}")


def default_n_voice(retention: float, n_heads: int) -> int:
    """§3.4's n_voice for the nearest listed target (ties go to the lower target), scaled to the model."""
    nearest = min(N_VOICE_FRACTION, key=lambda r: (abs(r - retention), r))
    return max(1, min(n_heads, math.floor(N_VOICE_FRACTION[nearest] * n_heads + 0.5)))


def default_n_anchor(retention: float, n_heads: int) -> int:
    """The paper's 5 anchors, fewer on small models: anchors keep all their audio on the device, so they
    may use at most half of the target budget (floor(0.5 * retention * heads), at least 1). Voxtral (240
    heads) and Qwen2.5-Omni (72) get 5 at every target of §3.4; tiny_random (12 heads) gets 1."""
    return max(1, min(PAPER_N_ANCHOR, math.floor(0.5 * retention * n_heads)))


def swap_sizes(token_rate: float, chunk_seconds: float, stride_seconds: float) -> tuple[int, int]:
    """(n_c, n_s) = (ceil(W_c r_tok), ceil(W_s r_tok)) of §2.3."""
    return math.ceil(chunk_seconds * token_rate - 1e-9), math.ceil(stride_seconds * token_rate - 1e-9)


def assign_roles(score: np.ndarray, n_voice: int, n_anchor: int) -> np.ndarray:
    """(L, H) array of ANCHOR / TIDAL / FIXED from a (L, H) importance score."""
    score = np.asarray(score, dtype=np.float64)
    n = score.size
    if not 0 <= n_voice <= n:
        raise TriageError(f"n_voice={n_voice} is outside [0, {n}] (the model has {n} KV heads)")
    if not 0 <= n_anchor <= n_voice:
        raise TriageError(f"n_anchor={n_anchor} must be between 0 and n_voice={n_voice}: anchors are the top "
                          "voice heads; lower n_anchor or raise n_voice")
    order = np.argsort(-score.ravel(), kind="stable")
    roles = np.full(n, FIXED, dtype=object)
    roles[order[:n_voice]] = TIDAL
    roles[order[:n_anchor]] = ANCHOR
    return roles.reshape(score.shape)


def normalised_scores(score: np.ndarray, roles: np.ndarray) -> np.ndarray:
    """s~ in [0, 1]: the score divided by its maximum over non-anchor heads; anchors get 1.

    Negative scores (not produced by VS or HS, which are >= 0) are clipped to 0. If every non-anchor
    score is 0 they all get s~ = 1 (nothing tells them apart; lambda alone sets their retention).
    """
    score = np.clip(np.asarray(score, dtype=np.float64), 0, None)
    other = roles != ANCHOR
    top = score[other].max() if other.any() else 0.0
    s = np.where(other, score / top if top > 0 else 1.0, 1.0)
    return np.clip(s, 0.0, 1.0)


def retentions(s_tilde: np.ndarray, roles: np.ndarray, lam: float) -> np.ndarray:
    """Eq. (1): min(s~ * lambda, 1) per head; anchors keep everything."""
    return np.where(roles == ANCHOR, 1.0, np.minimum(np.asarray(s_tilde) * lam, 1.0))


def segment_bounds(n_audio: int, n_s: int) -> list[tuple[int, int]]:
    """[start, end) of the n_s-token segments covering the audio; the last one may be shorter."""
    if n_s <= 0:
        raise ValueError("segment length must be positive")
    return [(s, min(s + n_s, n_audio)) for s in range(0, n_audio, n_s)]


def chunk_bounds(n_audio: int, n_c: int, n_s: int) -> list[tuple[int, int]]:
    """[start, end) of the chunks: n_c tokens every n_s tokens (§2.3), clipped to the audio, the last
    chunk the first one that reaches the end. With W_c = 2 W_s chunk c spans segments c and c + 1."""
    if n_audio <= 0:
        return []
    chunks, start = [], 0
    while True:
        chunks.append((start, min(start + n_c, n_audio)))
        if start + n_c >= n_audio:
            return chunks
        start += n_s


def kept_per_head(ret: float, n_audio: int, n_s: int, retention_one_keeps_all: bool = True,
                  quota: str = "floor") -> int:
    """Audio positions a non-anchor head keeps at prefill: sum over segments of floor(ret * length)
    (`quota="floor"`, §2.3), or floor(ret * n_audio) with the remainders spread (`quota="spread"`)."""
    if retention_one_keeps_all and ret >= 1.0:
        return n_audio
    if quota == "spread":
        return math.floor(ret * n_audio + _EPS)
    full, rest = divmod(n_audio, n_s)
    return full * math.floor(ret * n_s + _EPS) + math.floor(ret * rest + _EPS)


def kept_counts(ret: np.ndarray, n_audio: int, n_s: int, quota: str = "floor") -> np.ndarray:
    """`kept_per_head` of every head at once (int64, `ret`'s shape): the same float64 arithmetic, so the same counts."""
    ret = np.asarray(ret, np.float64)
    if quota == "spread":
        kept = np.floor(ret * n_audio + _EPS)
    else:
        full, rest = divmod(n_audio, n_s)
        kept = full * np.floor(ret * n_s + _EPS) + np.floor(ret * rest + _EPS)
    return np.where(ret >= 1.0, n_audio, kept).astype(np.int64)


def segment_quotas(ret: float, n_audio: int, n_s: int, quota: str = "floor") -> np.ndarray:
    """Positions each segment keeps: floor(ret * length) (`floor`), or floor(ret * end) - floor(ret * start)
    (`spread`: the same fractional budget, the remainders handed to every 1/frac-th segment)."""
    if quota not in QUOTAS:
        raise ValueError(f"unknown quota {quota!r}; choose one of {', '.join(QUOTAS)}")
    bounds = np.array(segment_bounds(n_audio, n_s), np.int64).reshape(-1, 2)
    if quota == "spread":
        cum = np.floor(ret * bounds + _EPS).astype(np.int64)
        return cum[:, 1] - cum[:, 0]
    return np.floor(ret * (bounds[:, 1] - bounds[:, 0]) + _EPS).astype(np.int64)


def prefill_r_gpu(ret: np.ndarray, roles: np.ndarray, n_audio: int, n_s: int, quota: str = "floor") -> float:
    """On-device audio fraction after prefill (§3.4's r_GPU before any recall)."""
    if n_audio == 0:
        return 1.0
    kept = int(np.where(np.asarray(roles) == ANCHOR, n_audio, kept_counts(ret, n_audio, n_s, quota)).sum())
    return kept / (np.size(roles) * n_audio)


def resident_segment_bounds(n_audio: int, n_s: int, n_c: int, top_k: int, delta: int,
                            max_recalled: int = 0) -> tuple[int, int]:
    """(fewest, most) segments the chunk swap can hold recalled at a decode step, in steady state.

    A chunk spans w = ceil(n_c / n_s) consecutive segments (chunks start every n_s tokens, on segment
    boundaries); a segment stays recalled while some chunk containing it was selected in one of the last
    `delta` steps (it is released after `delta` consecutive unselected steps), so the recalled set is the
    union of the last `delta` selections of k = min(top_k, number of chunks) chunks.
    - fewest: attention that never moves and k adjacent chunks, whose union is k + w - 1 segments;
    - most: every step selects k chunks that share no segment with each other or with the other selections
      of the window, delta * k * w segments.
    Both are capped at the number of segments, and the most at `max_recalled` (> 0: the swap's cap, `ChunkSwap`);
    when every chunk is selected at every step (k = number of chunks) every segment is recalled and the two
    coincide.
    """
    if n_audio <= 0:
        return 0, 0
    n_seg = math.ceil(n_audio / n_s)
    n_chunks = len(chunk_bounds(n_audio, n_c, n_s))
    k = min(top_k, n_chunks)
    if k == n_chunks:
        return n_seg, n_seg
    w = max(1, math.ceil(n_c / n_s))
    most = min(n_seg, delta * k * w, max_recalled or n_seg)
    return min(most, k + w - 1), most


def smallest_recall_cap(top_k: int, n_c: int, n_s: int) -> int:
    """The least `max_recalled` a chunk swap can have: one step's selection, top_k chunks of ceil(n_c / n_s)
    segments each, must fit (a step never releases what it selects)."""
    return top_k * max(1, math.ceil(n_c / n_s))


def peak_recalled_segments(n_audio: int, n_s: int, n_c: int, top_k: int, delta: int, max_recalled: int = 0) -> int:
    """The most segments a tidal head can hold recalled at once on a store that applies releases lazily.

    After the decision of step s the recalled set is the union of the last `delta` selections (at most
    `resident_segment_bounds`' delta * k * w segments); but a store that queues releases until its next flush
    (PackedAudioKVStore) still holds the segments released by that decision while the ones it recalls are
    queued, i.e. the union of the selections of steps s - delta .. s: at most (delta + 1) * k * w segments,
    capped at the number of segments (all of them when every chunk is selected at every step). With a cap
    `max_recalled` (> 0, `ChunkSwap`) the swap holds at most that many after a decision, and the store at most the
    cap plus one selection's k * w segments while a flush is pending.
    """
    if n_audio <= 0:
        return 0
    n_seg = math.ceil(n_audio / n_s)
    n_chunks = len(chunk_bounds(n_audio, n_c, n_s))
    k = min(top_k, n_chunks)
    if k == n_chunks:
        return n_seg
    w = max(1, math.ceil(n_c / n_s))
    most = (delta + 1) * k * w
    if max_recalled:
        most = min(most, max_recalled + k * w)
    return min(n_seg, most)


def expected_resident_segments(n_audio: int, n_s: int, n_c: int, top_k: int, delta: int, mobility: float,
                               max_recalled: int = 0) -> float:
    """Expected number of recalled segments at a decode step: fewest + mobility * (most - fewest) of
    `resident_segment_bounds`. `mobility` in [0, 1] says how fast the anchors' attention moves between
    chunks: 0 = it stays on one run of adjacent chunks, 1 = every step brings k chunks disjoint from
    everything selected in the delta-step window. The first delta - 1 steps, whose window is shorter, are
    not modelled (a few steps out of the hundreds a long clip decodes)."""
    if not 0 <= mobility <= 1:
        raise ValueError(f"mobility={mobility} is outside [0, 1]")
    lo, hi = resident_segment_bounds(n_audio, n_s, n_c, top_k, delta, max_recalled)
    return lo + mobility * (hi - lo)


def mobility_of(resident: float, n_audio: int, n_s: int, n_c: int, top_k: int, delta: int) -> float | None:
    """The mobility that `expected_resident_segments` maps to a measured mean `resident` segment count
    (clipped to [0, 1]); None when the bounds coincide (nothing to learn from this sample)."""
    lo, hi = resident_segment_bounds(n_audio, n_s, n_c, top_k, delta)
    if hi <= lo:
        return None
    return float(min(1.0, max(0.0, (resident - lo) / (hi - lo))))


def recall_room(ret: np.ndarray, roles: np.ndarray, n_audio: int, n_s: int, segments: int,
                selection: str = "segment", quota: str = "floor", window_segments: int = 0) -> np.ndarray:
    """(L, H) the most positions each head can hold recalled at once when the chunk swap holds `segments` segments:
    for a tidal head the sum of its `segments` largest per-segment host-tier counts (a segment's length minus its
    prefill quota, `block_quotas`); 0 for anchors and fixed heads, which never recall. With `selection="global"`
    the prefill counts per segment depend on the scores, so the bound is the head's whole host tier or the
    `segments` longest segments, whichever is smaller. The store's recall room (`WnW.recall_headroom`) is the same
    count read from the placed masks, never more than this. `window_segments` > 0 (`method.fixed_window`): every
    fixed head with retention < 1 gets the same count for that many segments (its window's room)."""
    ret = np.asarray(ret, np.float64)
    room = np.zeros(ret.shape, np.int64)
    tidal = np.asarray(roles) == TIDAL
    window = (np.asarray(roles) == FIXED) & (ret < 1.0) if window_segments > 0 else np.zeros(ret.shape, bool)
    if n_audio <= 0 or not (tidal.any() and segments > 0 or window.any()):
        return room
    bounds = np.array(segment_bounds(n_audio, n_s), np.int64).reshape(-1, 2)
    length = bounds[:, 1] - bounds[:, 0]
    if selection == "global":
        missing = n_audio - kept_counts(ret, n_audio, n_s, quota)
        longest = np.cumsum(np.sort(length)[::-1])
        room_of = lambda k: np.minimum(missing, longest[min(k, len(longest)) - 1] if k > 0 else 0)  # noqa: E731
    else:
        quotas, _ = block_quotas(ret, n_audio, n_s, "segment", quota)
        by_size = np.sort(length - quotas, axis=-1)[..., ::-1]
        room_of = lambda k: by_size[..., :k].sum(axis=-1)  # noqa: E731
    room[tidal] = room_of(segments)[tidal]
    room[window] = room_of(window_segments)[window]
    return room


def peak_r_gpu(ret: np.ndarray, roles: np.ndarray, n_audio: int, n_s: int, segments: int, selection: str = "segment",
               quota: str = "floor", window_segments: int = 0) -> float:
    """The most on-device audio r_GPU can reach at any decode step: the prefill footprint plus every tidal head's
    `recall_room` for `segments` recalled segments (the chunk swap never holds more: `peak_recalled_segments`), and
    with `window_segments` every fixed head's window room (`method.fixed_window`)."""
    if n_audio == 0:
        return 1.0
    room = recall_room(ret, roles, n_audio, n_s, segments, selection, quota, window_segments)
    return prefill_r_gpu(ret, roles, n_audio, n_s, quota) + int(room.sum()) / (np.size(roles) * n_audio)


def demote_tidal(importance: np.ndarray, roles: np.ndarray, n_audio: int, n_s: int, segments: int, target: float,
                 selection: str = "segment", quota: str = "floor", window_segments: int = 0) -> np.ndarray:
    """Roles under which the peak r_GPU at lambda = 0 (anchors whole, every other head's prefill share 0, the tidal
    heads' recall room) fits `target`: the least important tidal heads become fixed heads, one at a time, until it
    does. A short clip whose every segment the swap can recall at once costs each tidal head its whole audio at the
    peak, more than a low target leaves; on long clips nothing changes. Returns `roles` itself when it fits. With
    `window_segments` a demoted head takes a fixed head's window room instead of its recall room."""
    zero = np.where(roles == ANCHOR, 1.0, 0.0)
    if peak_r_gpu(zero, roles, n_audio, n_s, segments, selection, quota, window_segments) <= target:
        return roles
    roles = roles.copy()
    flat, imp = roles.reshape(-1), np.asarray(importance, np.float64).reshape(-1)
    order = [i for i in np.argsort(imp, kind="stable") if flat[i] == TIDAL]  # least important first (ties: earlier)
    # At lambda = 0 a fixed head keeps nothing, as a tidal head does: demoting one only swaps its recall room for a
    # fixed head's window room (0 without a window) on the peak (`peak_r_gpu` after each demotion, the same arithmetic).
    base = prefill_r_gpu(zero, roles, n_audio, n_s, quota)
    room = recall_room(zero, roles, n_audio, n_s, segments, selection, quota, window_segments).reshape(-1)
    as_fixed = np.where(roles == TIDAL, FIXED, roles)
    window = recall_room(zero, as_fixed, n_audio, n_s, segments, selection, quota, window_segments).reshape(-1)
    left = int(room.sum()) - np.cumsum(room[order] - window[order])
    fits = np.flatnonzero(base + left / (np.size(roles) * n_audio) <= target)
    flat[order[: fits[0] + 1 if fits.size else len(order)]] = FIXED
    return roles


@dataclass
class LambdaSolution:
    lam: float
    r_gpu: float  # realised prefill r_GPU plus the expected recall (when asked for)
    saturated: bool  # every non-anchor head at retention 1


def expected_r_gpu(ret: np.ndarray, roles: np.ndarray, n_audio: int, n_s: int, resident_fraction: float = 0.0,
                   quota: str = "floor") -> float:
    """Prefill r_GPU plus the expected decode-time recall (§3.4's r_GPU is the mean over decode steps).

    `resident_fraction`: the expected share of the segments that are recalled at a step
    (`expected_resident_segments` / number of segments). A recalled segment brings back, for every tidal
    head, the positions of that segment its prefill selection did not keep; with every segment equally
    likely to be recalled, a tidal head that misses m of the n_audio positions has resident_fraction * m
    of them on the device on average (exact per segment for the per-segment selection, whose full
    segments all miss the same count). 0: the prefill footprint alone.
    """
    r = prefill_r_gpu(ret, roles, n_audio, n_s, quota)
    if resident_fraction and n_audio:
        tidal = np.asarray(roles) == TIDAL
        missing = int((n_audio - kept_counts(ret, n_audio, n_s, quota))[tidal].sum())
        r += resident_fraction * missing / (np.size(roles) * n_audio)
    return r


def solve_peak_lambda(s_tilde: np.ndarray, roles: np.ndarray, n_audio: int, n_s: int, target: float,
                      segments: int, selection: str = "segment", quota: str = "floor",
                      iterations: int = 100, window_segments: int = 0) -> LambdaSolution:
    """The largest lambda whose `peak_r_gpu` (prefill footprint plus the tidal heads' recall room for `segments`
    recalled segments, exact integer counts) is at most `target`: the r_GPU of every decode step then stays at or
    under the target. peak(lambda) is a non-decreasing step function (a position a tidal head keeps at prefill
    leaves its recall room, one a fixed head keeps is new), so bisection finds the last step at or under the
    target. Raises TriageError when even lambda = 0 does not fit (anchors alone, or the tidal heads' recall room:
    `demote_tidal` first)."""
    others = roles != ANCHOR
    positive = s_tilde[others & (s_tilde > 0)]
    lam_max = 1.0 / positive.min() if positive.size else 1.0

    def r(lam: float) -> float:
        return peak_r_gpu(retentions(s_tilde, roles, lam), roles, n_audio, n_s, segments, selection, quota,
                          window_segments)

    r_low, r_high = r(0.0), r(lam_max)
    if r_low > target:
        n_anchor, n_tidal = int((roles == ANCHOR).sum()), int((roles == TIDAL).sum())
        raise TriageError(f"the {n_anchor} anchor heads and the recall room of {n_tidal} tidal heads alone reach "
                          f"r_GPU = {r_low:.3f}, above the target {target}: lower n_anchor or n_voice"
                          f"{' or method.fixed_window' if window_segments else ''} (or raise the retention target)")
    if r_high <= target:
        return LambdaSolution(lam_max, r_high, True)
    lo, hi = 0.0, lam_max  # r(lo) <= target < r(hi)
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):  # adjacent floats: no later step changes lo or hi
            break
        if r(mid) <= target:
            lo = mid
        else:
            hi = mid
    return LambdaSolution(lo, r(lo), bool(np.all(retentions(s_tilde, roles, lo)[others] >= 1.0)))


def solve_lambda(s_tilde: np.ndarray, roles: np.ndarray, n_audio: int, n_s: int, target: float,
                 tolerance: float = 0.005, iterations: int = 100, resident_fraction: float = 0.0,
                 quota: str = "floor") -> LambdaSolution:
    """lambda such that the realised prefill r_GPU plus the expected recall (`expected_r_gpu` with
    `resident_fraction`) is as close to `target` as the floors allow.

    r(lambda) is a non-decreasing step function (for resident_fraction <= 1: a kept position counts 1, a
    recallable one resident_fraction). Bisection brackets the first step at or above the target; of that
    step and the one just below, the closer wins. Raises TriageError when the anchors alone keep more than
    target + tolerance, and warns and returns lambda = 0 when the expected recall alone pushes r(0) above
    it; warns when the steps are too coarse to come within tolerance.
    """
    if not 0 <= resident_fraction <= 1:
        raise ValueError(f"resident_fraction={resident_fraction} is outside [0, 1]")
    others = roles != ANCHOR
    positive = s_tilde[others & (s_tilde > 0)]
    lam_max = 1.0 / positive.min() if positive.size else 1.0

    def r(lam: float) -> float:
        return expected_r_gpu(retentions(s_tilde, roles, lam), roles, n_audio, n_s, resident_fraction, quota)

    r_low, r_high = r(0.0), r(lam_max)
    anchors_alone = prefill_r_gpu(retentions(s_tilde, roles, 0.0), roles, n_audio, n_s, quota)
    if anchors_alone > target + tolerance:
        n_anchor = int((roles == ANCHOR).sum())
        raise TriageError(f"the {n_anchor} anchor heads alone keep r_GPU = {anchors_alone:.3f} on the device, above "
                          f"the target {target}: lower n_anchor (or raise the retention target)")
    if r_high <= target:
        return LambdaSolution(lam_max, r_high, True)
    lo, hi = 0.0, lam_max  # r(lo) < target <= r(hi)
    if r_low >= target:
        if r_low > target + tolerance:
            warnings.warn(f"lambda: even lambda = 0 (non-anchor heads keep no audio at prefill) expects r_GPU = "
                          f"{r_low:.4f} for target {target}: the tidal heads' expected recall ({n_audio} audio "
                          "tokens) alone exceeds the rest of the budget; running at lambda = 0", stacklevel=2)
        return LambdaSolution(0.0, r_low, False)
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):  # adjacent floats: no later step changes lo or hi
            break
        if r(mid) >= target:
            hi = mid
        else:
            lo = mid
    r_lo, r_hi = r(lo), r(hi)
    lam, got = (lo, r_lo) if target - r_lo < r_hi - target else (hi, r_hi)
    if abs(got - target) > tolerance:
        warnings.warn(f"lambda: the closest realisable (expected) r_GPU is {got:.4f} for target {target} "
                      f"({n_audio} audio tokens are too few for finer steps)", stacklevel=2)
    return LambdaSolution(lam, got, bool(np.all(retentions(s_tilde, roles, lam)[others] >= 1.0)))


def select_positions(scores: torch.Tensor, ret: float, n_s: int, selection: str = "segment",
                     quota: str = "floor") -> torch.Tensor:
    """Audio positions (sorted, long) a non-anchor head keeps at prefill.

    `segment`: within each n_s-token segment its quota (`segment_quotas`) of top positions by score
    (uniform coverage); `global`: the top-k over the whole head with k the same total (ablation A2). Ties
    keep the earlier position.
    """
    n = scores.shape[0]
    if selection not in SELECTIONS:
        raise ValueError(f"unknown selection {selection!r}; choose one of {', '.join(SELECTIONS)}")
    if ret >= 1.0:
        return torch.arange(n, device=scores.device)
    scores = scores.float()
    if selection == "global":
        k = kept_per_head(ret, n, n_s, quota=quota)
        idx = _stable_topk(scores, k)
        return torch.sort(idx).values
    if quota == "spread":
        return _select_by_quota(scores, segment_quotas(ret, n, n_s, quota), n_s)
    full, rest = divmod(n, n_s)
    k_full = math.floor(ret * n_s + _EPS)
    parts = []
    if full and k_full:
        block = scores[: full * n_s].view(full, n_s)
        top = _stable_topk(block, k_full)  # (full, k_full)
        parts.append((top + torch.arange(full, device=scores.device)[:, None] * n_s).flatten())
    k_rest = math.floor(ret * rest + _EPS)
    if rest and k_rest:
        parts.append(_stable_topk(scores[full * n_s:], k_rest) + full * n_s)
    if not parts:
        return torch.zeros(0, dtype=torch.long, device=scores.device)
    return torch.sort(torch.cat(parts)).values


def block_quotas(ret: np.ndarray, n_audio: int, n_s: int, selection: str = "segment",
                 quota: str = "floor") -> tuple[np.ndarray, int]:
    """What `select_positions` keeps of each block of a head's audio, for every head at once: (quotas, block).

    `ret` has any shape (e.g. (L, H_kv)); quotas has that shape plus one axis of ceil(n_audio / block) blocks.
    `selection="segment"`: blocks of n_s tokens with their `segment_quotas`; `"global"`: one block of all the
    audio with `kept_per_head`. A head with ret >= 1 keeps its whole blocks. The same float64 arithmetic as the
    per-head functions, so the same counts.
    """
    if selection not in SELECTIONS:
        raise ValueError(f"unknown selection {selection!r}; choose one of {', '.join(SELECTIONS)}")
    if quota not in QUOTAS:
        raise ValueError(f"unknown quota {quota!r}; choose one of {', '.join(QUOTAS)}")
    ret = np.asarray(ret, np.float64)[..., None]
    if selection == "global":
        block, bounds = n_audio, np.array([[0, n_audio]] if n_audio else [], np.int64).reshape(-1, 2)
    else:
        block, bounds = n_s, np.array(segment_bounds(n_audio, n_s), np.int64).reshape(-1, 2)
    length = bounds[:, 1] - bounds[:, 0]
    if quota == "spread":
        kept = np.floor(ret * bounds[:, 1] + _EPS) - np.floor(ret * bounds[:, 0] + _EPS)
    elif selection == "global":  # kept_per_head: floor(ret * n_s) per full segment, floor(ret * rest) for the rest
        full, rest = divmod(n_audio, n_s)
        total = full * np.floor(ret * n_s + _EPS) + np.floor(ret * rest + _EPS)
        kept = np.broadcast_to(total, ret.shape[:-1] + length.shape)
    else:
        kept = np.floor(ret * length + _EPS)
    return np.where(ret >= 1.0, length, kept).astype(np.int64), block


def select_masks(scores: torch.Tensor, quotas: torch.Tensor, block: int) -> torch.Tensor:
    """`select_positions` of several heads at once, as a mask: (H, n) bool, True at the positions each head keeps.

    scores (H, n); quotas (H, ceil(n / block)) long on the scores' device (`block_quotas`): within each block of
    `block` positions a head keeps its quota of top positions by score, ties to the earlier position (one stable
    sort of every block of every head). Fixed shapes throughout: no host read.
    """
    H, n = scores.shape
    if n == 0:
        return torch.zeros(H, 0, dtype=torch.bool, device=scores.device)
    scores = scores.float()
    pad = (-n) % block  # the last block's missing tail ranks after every real position (stable sort)
    x = torch.cat([scores, scores.new_full((H, pad), float("-inf"))], dim=1).view(H, -1, block)
    return top_masks(x, quotas).view(H, -1)[:, :n]  # each block's first quota of its order


def _select_by_quota(scores: torch.Tensor, quotas: np.ndarray, n_s: int) -> torch.Tensor:
    """Within segment i the top quotas[i] positions (ties: the earlier), sorted."""
    n = scores.shape[0]
    pad = (-n) % n_s
    block = torch.cat([scores, scores.new_full((pad,), float("-inf"))]).view(-1, n_s)
    order = torch.sort(block, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(n_s, device=scores.device).expand_as(order).contiguous())
    keep = rank < torch.as_tensor(quotas, device=scores.device)[:, None]
    return keep.flatten()[:n].nonzero().flatten()


def _stable_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim; equal values keep the earlier index."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def window_segments(chunk_segments: list[list[int]], n_seg: int, size: int) -> np.ndarray:
    """(n_chunks, n_seg) bool: the `size` consecutive segments centred on each chunk (`method.fixed_window`), i.e.
    starting (chunk length in segments - size) // 2 segments after the chunk's first one, shifted to lie inside
    [0, n_seg) (every segment when size >= n_seg). Size 2 with 2-segment chunks is the chunk itself."""
    table = np.zeros((len(chunk_segments), n_seg), bool)
    size = min(size, n_seg)
    for c, segs in enumerate(chunk_segments):
        start = min(max(segs[0] + (len(segs) - size) // 2, 0), n_seg - size)
        table[c, start:start + size] = True
    return table


def complement(positions: torch.Tensor, n: int) -> torch.Tensor:
    """Sorted positions of [0, n) not in `positions`."""
    keep = torch.ones(n, dtype=torch.bool, device=positions.device)
    keep[positions] = False
    return keep.nonzero().flatten()


def check_locality(locality, top_k: int) -> int:
    """`method.locality`, checked: 0 (off) or a number of chunks >= top_k - 1 (the window must hold top_k chunks)."""
    if isinstance(locality, bool) or not isinstance(locality, int) or locality < 0 or 0 < locality < top_k - 1:
        raise ValueError(f"method.locality={locality!r}: 0 (off, the paper) or how many chunks from the anchors' "
                         f"focus the other chunks of a decision may lie, >= top_k - 1 = {top_k - 1}")
    return locality


class ChunkSwap:
    """The decode-time chunk selection and segment state machine of §2.3, on plain arrays.

    `step(a)` takes one decode step's aggregated anchor attention A (n_audio,) and returns the selected
    chunks (top-k by the mean of A over each chunk; ties: the earlier chunk), the segments to recall
    (belonging to a selected chunk and not recalled yet) and the segments to release (recalled, and in
    no selected chunk for `delta` consecutive steps). State is per segment and shared by all tidal heads,
    which all follow the same anchor signal.

    `max_recalled` > 0 (`method.max_recalled`, beyond the paper; 0 is the paper) caps the segments recalled after a
    decision: where the rule above leaves more, the idle recalled segments (in no selected chunk) go early, the
    longest unselected first, ties to the least mean attention of this step's A over the segment, then the
    earlier segment. The cap must hold one step's selection (`smallest_recall_cap`).

    `locality` > 0 (`method.locality`, beyond the paper; 0 is the paper) keeps a selection near the anchors' focus:
    the top chunk is chosen as before, the other top_k - 1 among the chunks at most `locality` chunks from it (by
    the same mean, ties to the earlier chunk). At least top_k - 1, so the window always holds top_k chunks.
    """

    def __init__(self, n_audio: int, n_s: int, n_c: int, top_k: int = 3, delta: int = 3, max_recalled: int = 0,
                 locality: int = 0):
        self.segments = segment_bounds(n_audio, n_s) if n_audio else []
        self.chunks = chunk_bounds(n_audio, n_c, n_s)
        self.chunk_segments = [list(range(cs // n_s, (ce - 1) // n_s + 1)) for cs, ce in self.chunks]
        self.top_k, self.delta = top_k, delta
        if max_recalled and max_recalled < (least := smallest_recall_cap(top_k, n_c, n_s)):
            raise ValueError(f"method.max_recalled={max_recalled}: one step selects up to {least} segments "
                             f"(top_k={top_k} chunks of {math.ceil(n_c / n_s)} segments); use 0 (no cap) or >= {least}")
        self.max_recalled = int(max_recalled)
        self.locality = check_locality(locality, top_k)
        self._seg_starts = np.array([s for s, _ in self.segments], np.int64)
        self._seg_ends = np.array([e for _, e in self.segments], np.int64)
        self.recalled = np.zeros(len(self.segments), dtype=bool)
        self.unselected = np.zeros(len(self.segments), dtype=np.int64)
        self._starts = np.array([s for s, _ in self.chunks], np.int64)
        self._ends = np.array([e for _, e in self.chunks], np.int64)
        self._c = np.zeros(n_audio + 1)  # the prefix sums of A (float64), reused every step

    def select(self, a: torch.Tensor | np.ndarray) -> list[int]:
        """Top-k chunks by the mean of A over each chunk (float64 prefix sums); ties: the earlier chunk. On the
        host in numpy (a device tensor is copied over once): the same float64 sums, in the same order, as a
        torch cumsum, so the same chunks."""
        a = a.detach().cpu().numpy() if torch.is_tensor(a) else np.asarray(a)
        c = self._c
        np.cumsum(a, dtype=np.float64, out=c[1:])
        mean = (c[self._ends] - c[self._starts]) / (self._ends - self._starts)
        k = min(self.top_k, len(self.chunks))
        order = np.argsort(-mean, kind="stable")
        self.focus = int(order[0])  # the anchors' focus: the top chunk (`window_segments`)
        if self.locality:  # (a stable filter of the same order: the focus stays first)
            order = order[np.abs(order - self.focus) <= self.locality]
        return sorted(order[:k].tolist())

    def update(self, selected_chunks: list[int]) -> tuple[list[int], list[int]]:
        wanted = sorted({s for c in selected_chunks for s in self.chunk_segments[c]})
        recall = [s for s in wanted if not self.recalled[s]]
        self.recalled[wanted] = True
        self.unselected[wanted] = 0
        idle = self.recalled.copy()
        idle[wanted] = False
        self.unselected[idle] += 1
        release = idle & (self.unselected >= self.delta)
        self.recalled[release] = False
        self.unselected[release] = 0
        excess = int(np.count_nonzero(self.recalled)) - self.max_recalled if self.max_recalled else 0
        if excess > 0:  # the cap: the idle segments longest unselected go first, then the least attended
            idle = np.flatnonzero(idle & ~release)  # (those still recalled)
            c = self._c
            mean = (c[self._seg_ends[idle]] - c[self._seg_starts[idle]]) / (self._seg_ends[idle] - self._seg_starts[idle])
            early = idle[np.lexsort((mean, -self.unselected[idle]))[:excess]]
            release[early] = True
            self.recalled[early] = False
            self.unselected[early] = 0
        return recall, np.flatnonzero(release).tolist()

    def step(self, a: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
        if not self.chunks:
            return [], [], []
        selected = self.select(a)
        return (selected, *self.update(selected))

    @property
    def recalled_fraction(self) -> float:
        """Fraction of the audio's segments currently recalled."""
        return int(np.count_nonzero(self.recalled)) / len(self.recalled) if len(self.recalled) else 0.0


class DeviceChunkSwap:
    """`ChunkSwap` on device tensors: the same chunks (top-k by the mean of A, from float64 prefix sums; ties: the
    earlier chunk), the same segment state machine, the decisions as masks; the state is updated in place and
    nothing reads the host, so a CUDA graph can capture `step`.

    `step(a)` returns (selected (n_chunks,), recall (n_seg,), release (n_seg,)) bool masks: what `ChunkSwap.step`
    returns as sorted lists. (A GPU's parallel prefix sum may round differently from the host's sequential one,
    which can only matter for chunks whose means tie to the last bit.)
    """

    def __init__(self, n_audio: int, n_s: int, n_c: int, top_k: int, delta: int, device: torch.device,
                 max_recalled: int = 0, locality: int = 0):
        host = ChunkSwap(n_audio, n_s, n_c, top_k, delta, max_recalled, locality)
        self.n_seg, self.n_chunks = len(host.segments), len(host.chunks)
        self.k, self.delta, self.max_recalled = min(top_k, self.n_chunks), delta, host.max_recalled
        self.locality = host.locality
        if self.locality:
            self.chunk_index = torch.arange(self.n_chunks, device=device)
        if self.max_recalled:
            self.seg_starts, self.seg_ends = to_device(host._seg_starts, device), to_device(host._seg_ends, device)
            self.seg_length = (self.seg_ends - self.seg_starts).double()
            self.seg_index = torch.arange(self.n_seg, device=device)
        self.starts = to_device(host._starts, device)  # (from pinned memory: no wait for a step in flight)
        self.ends = to_device(host._ends, device)
        self.length = (self.ends - self.starts).double()
        member = np.zeros((self.n_chunks, self.n_seg), bool)  # chunk -> segments
        for c, segs in enumerate(host.chunk_segments):
            member[c, segs] = True
        self.member = to_device(member, device)
        self.recalled = torch.zeros(self.n_seg, dtype=torch.bool, device=device)
        self.unselected = torch.zeros(self.n_seg, dtype=torch.long, device=device)
        self._c = torch.zeros(n_audio + 1, dtype=torch.float64, device=device)

    def step(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        torch.cumsum(a.double(), 0, out=self._c[1:])
        mean = (self._c[self.ends] - self._c[self.starts]) / self.length
        top = torch.sort(-mean, stable=True).indices
        if self.locality:  # the others near the focus (`ChunkSwap`): the far chunks sorted last, the order kept
            far = (self.chunk_index - top[0]).abs() > self.locality
            top = top[torch.sort(far[top].to(torch.int8), stable=True).indices]
        top = self.top = top[: self.k]  # top[0]: the anchors' focus chunk
        selected = torch.zeros(self.n_chunks, dtype=torch.bool, device=a.device).index_fill_(0, top, True)
        wanted = (self.member & selected[:, None]).any(dim=0)
        recall = wanted & ~self.recalled
        self.recalled |= wanted
        self.unselected.masked_fill_(wanted, 0)
        idle = self.recalled & ~wanted
        self.unselected += idle
        release = idle & (self.unselected >= self.delta)
        self.recalled &= ~release
        self.unselected.masked_fill_(release, 0)
        if self.max_recalled:  # the cap (`ChunkSwap`): the same order, from two stable sorts, no host read
            excess = self.recalled.sum() - self.max_recalled
            mean = (self._c[self.seg_ends] - self._c[self.seg_starts]) / self.seg_length
            by_mean = torch.sort(mean, stable=True).indices
            key = torch.where(self.recalled & ~wanted, self.unselected, -1)[by_mean]
            order = by_mean[torch.sort(-key, stable=True).indices]
            early = torch.zeros_like(release).index_copy_(0, order, self.seg_index < excess)
            early &= self.recalled & ~wanted
            release |= early
            self.recalled &= ~early
            self.unselected.masked_fill_(early, 0)
        return selected, recall, release
