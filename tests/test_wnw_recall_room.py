"""WnW on the packed GPU store: each tidal head's recall room is what the chunk swap can hold at once.

The room (`WnW.recall_headroom`) is the sum of a tidal head's `triage.peak_recalled_segments` largest
per-segment host-tier counts: delta + 1 selections of top_k chunks (the packed store releases lazily, so the
segments a decision releases are still held while the ones it recalls are queued). Attention that jumps to
chunks disjoint from everything recent reaches that peak exactly; one row less and the store refuses the recall.
No kernel runs here (moves only), so this needs neither CUDA nor Triton.
"""

import numpy as np
import pytest
import torch
from helpers import placed_two_layer_sample, scores_for

from wnw_exp.methods.wnw import triage
from wnw_exp.kv.packed import PackedAudioKVStore
from wnw_exp.kv.reference import AudioKVStore
from wnw_exp.methods.wnw import WnW

N_AUDIO = 200  # 20 segments of 10 tokens, chunks of 20 tokens every 10 (19 chunks)


def test_peak_recalled_segments_by_hand():
    # n_s = 25, n_c = 50 (w = 2), top_k = delta = 3: (3 + 1) * 3 * 2 = 24 segments, capped at the segment count
    assert triage.peak_recalled_segments(3000, 25, 50, 3, 3) == 24
    assert triage.peak_recalled_segments(400, 25, 50, 3, 3) == 16
    assert triage.peak_recalled_segments(100, 25, 50, 3, 3) == 4  # 3 chunks: every one selected, all 4 segments
    assert triage.peak_recalled_segments(0, 25, 50, 3, 3) == 0
    lo, hi = triage.resident_segment_bounds(3000, 25, 50, 3, 3)
    assert hi == 18 < triage.peak_recalled_segments(3000, 25, 50, 3, 3)


def _setup(store_cls, delta=3, selection="segment", room_delta=0):
    scores = scores_for([[1.0, 0.2], [0.1, 0.5]], np.ones((2, 2)))
    policy = WnW(scores=scores, n_voice=2, n_anchor=1, lam=0.5, chunk_seconds=1.6, stride_seconds=0.8, top_k=1,
                 delta=delta, selection=selection)
    return placed_two_layer_sample(policy, store_cls, N_AUDIO, 0.3, room_delta)


def _jump(policy, store, s):
    """Anchor attention on chunk 2s (mod 19): every step's chunk shares no segment with the last delta ones."""
    p = torch.full((2, N_AUDIO), 1e-4)
    start = (20 * s) % 180
    p[:, start:start + 20] = 0.05
    policy.observe(0, p)
    policy.after_step(s)


@pytest.mark.parametrize("selection", ["segment", "global"])
def test_recall_room_is_reached_and_never_exceeded(selection):
    policy, store = _setup(PackedAudioKVStore, selection=selection)
    ref_policy, ref = _setup(AudioKVStore, selection=selection)
    room = policy.recall_headroom
    r = 1 * 2 + 1  # the tidal head (1, 1)
    assert (room[[0, 1, 2]] == 0).all()  # anchor and fixed heads recall nothing
    per_seg = np.bincount(policy.offloaded[(1, 1)].numpy() // 10, minlength=20)
    assert room[r] == np.sort(per_seg)[::-1][:8].sum() < per_seg.sum()  # (3 + 1) * 1 * 2 = 8 of 20 segments
    prefill = int(store.n_resident[r])
    assert store.caps[r] == prefill + room[r]
    peak = 0
    for s in range(12):
        _jump(policy, store, s)
        _jump(ref_policy, ref, s)
        peak = max(peak, int(store.n_resident[r] + store.queued_recall[r].sum()) - prefill)
        store.flush()
        store.end_step()
        ref.end_step()
        got = (store.slot_of[r] >= 0).nonzero().flatten().tolist()
        assert got == sorted(ref.heads[1][1].gpu_pos.tolist())  # same positions on the device as the reference
    if selection == "segment":  # every segment misses as many positions: the bound is reached, it is tight
        assert peak == room[r] == 8 * 5
    assert 0 < peak <= room[r]


def test_one_row_less_and_the_store_refuses_the_recall():
    policy, store = _setup(PackedAudioKVStore, room_delta=-1)
    with pytest.raises(RuntimeError, match="region is full"):
        for s in range(12):
            _jump(policy, store, s)
            store.flush()
            store.end_step()
