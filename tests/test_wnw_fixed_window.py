"""`method.fixed_window`: the fixed heads hold a window of segments around the anchors' focus chunk.

Checked against references written here, independently of the policy: the window's segments from the focus
chunk's token span, the positions a fixed head holds at each step (its prefill selection plus the window's host-tier
positions) on the reference store, the packed store's positions against the reference store's, the window's room in
the peak r_GPU and the lambda solve, and the knob's validation. The anchor attention is built by hand so that its
focus jumps to a chunk far from the previous ones at every step. No kernel runs here (moves only).
"""

import functools
import importlib.util
import os

import numpy as np
import pytest
import torch
from helpers import placed_two_layer_sample, resident_positions, scores_for

from wnw_exp.kv.packed import PackedAudioKVStore
from wnw_exp.kv.reference import AudioKVStore
from wnw_exp.methods.wnw import WnW, triage

N_AUDIO, N_S = 200, 10  # 20 segments of 10 tokens, chunks of 20 tokens every 10 (19 chunks)


def _window_ref(chunk_start: int, size: int) -> set[int]:
    """The `size` segments centred on the chunk [chunk_start, chunk_start + 20) tokens, shifted into the audio."""
    centre = chunk_start + 10  # the chunk's middle, a segment boundary
    lo = centre - size * N_S // 2 if size % 2 == 0 else centre - (size + 1) * N_S // 2  # odd: one more behind
    lo = min(max(lo, 0), N_AUDIO - size * N_S)
    return set(range(lo // N_S, lo // N_S + size))


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_window_segments_against_token_spans(size):
    swap = triage.ChunkSwap(N_AUDIO, N_S, 2 * N_S)
    table = triage.window_segments(swap.chunk_segments, len(swap.segments), size)
    assert table.shape == (19, 20)
    for c in range(19):
        assert set(np.flatnonzero(table[c]).tolist()) == _window_ref(10 * c, size), c
    assert triage.window_segments(swap.chunk_segments, 20, 30).all()  # larger than the audio: every segment


def test_peak_r_gpu_adds_each_fixed_heads_window_room():
    roles = np.array([[triage.ANCHOR, triage.TIDAL], [triage.FIXED, triage.FIXED]], dtype=object)
    ret = np.array([[1.0, 0.5], [0.2, 1.0]])  # the fixed head at retention 1 keeps everything: no window
    # the fixed head at 0.2 keeps 2 of each 10-token segment: a window of 4 segments brings back 4 * 8 positions
    base = triage.peak_r_gpu(ret, roles, N_AUDIO, N_S, 8)
    with_window = triage.peak_r_gpu(ret, roles, N_AUDIO, N_S, 8, window_segments=4)
    assert with_window - base == pytest.approx(32 / (4 * N_AUDIO))
    room = triage.recall_room(ret, roles, N_AUDIO, N_S, 8, window_segments=4)
    assert room.tolist() == [[0, 8 * 5], [32, 0]]


def test_peak_solve_keeps_the_window_under_the_target():
    importance = np.array([[1.0, 0.5], [0.3, 0.2]])
    roles = triage.assign_roles(importance, 2, 1)
    s = triage.normalised_scores(importance, roles)
    for window in (0, 2, 6):
        lam = triage.solve_peak_lambda(s, roles, N_AUDIO, N_S, 0.55, 8, window_segments=window).lam
        peak = lambda x: triage.peak_r_gpu(triage.retentions(s, roles, x), roles, N_AUDIO, N_S, 8,  # noqa: E731
                                           window_segments=window)
        assert peak(lam) <= 0.55 < peak(lam * 1.05 + 0.01)
    # a larger window leaves less for the prefill: lambda falls
    lams = [triage.solve_peak_lambda(s, roles, N_AUDIO, N_S, 0.55, 8, window_segments=w).lam for w in (0, 2, 6)]
    assert lams[0] > lams[1] > lams[2]


def _setup(store_cls, fixed_window, room_delta=0):
    scores = scores_for([[1.0, 0.2], [0.1, 0.5]], np.ones((2, 2)))  # anchor (0,0), tidal (1,1), fixed (0,1), (1,0)
    policy = WnW(scores=scores, n_voice=2, n_anchor=1, lam=0.5, chunk_seconds=1.6, stride_seconds=0.8, top_k=1,
                 delta=3, fixed_window=fixed_window)
    return placed_two_layer_sample(policy, store_cls, N_AUDIO, 0.3, room_delta)


def _focus_at(s: int) -> int:
    """The token where step s's anchor attention sits: chunks far apart, jumping back and forth."""
    return [0, 160, 40, 180, 100, 20, 140, 60, 120, 80][s % 10]


def _step(policy, s):
    p = torch.full((2, N_AUDIO), 1e-4)
    p[:, _focus_at(s):_focus_at(s) + 20] = 0.05
    policy.observe(0, p)
    policy.after_step(s)


def test_fixed_heads_hold_their_window_where_the_focus_jumps():
    policy, store = _setup(AudioKVStore, fixed_window=4)
    plain, plain_store = _setup(AudioKVStore, fixed_window=0)
    assert policy.knobs()["n_window"] == 2 and policy.roles[0, 1] == policy.roles[1, 0] == triage.FIXED
    fixed = [(0, 1), (1, 0)]
    prefill = {h: resident_positions(store, *h) for h in fixed}
    assert prefill == {h: resident_positions(plain_store, *h) for h in fixed}  # the same prefill selection
    assert all(len(prefill[h]) < N_AUDIO for h in fixed)
    for s in range(12):
        _step(policy, s)
        _step(plain, s)
        window = {p for g in _window_ref(_focus_at(s), 4) for p in range(g * N_S, (g + 1) * N_S)}
        for h in fixed:  # the prefill subset and the whole window, nothing else
            assert resident_positions(store, *h) == prefill[h] | window, (s, h)
            assert resident_positions(plain_store, *h) == prefill[h]  # without the knob a fixed head never moves
        assert resident_positions(store, 1, 1) == resident_positions(plain_store, 1, 1)  # the tidal head is untouched
        assert policy.trace()["wnw"]["window_segments"][-1] == sorted(_window_ref(_focus_at(s), 4))


def test_packed_store_holds_what_the_reference_holds_within_its_room():
    policy, store = _setup(PackedAudioKVStore, fixed_window=4)
    ref_policy, ref = _setup(AudioKVStore, fixed_window=4)
    room = policy.recall_headroom
    per_seg = np.bincount(policy.offloaded[(0, 1)].numpy() // N_S, minlength=20)
    assert room[1] == np.sort(per_seg)[::-1][:8].sum()  # twice the window: the left one is released lazily
    assert room[0] == 0 and room[3] > 0
    prefill = int(store.n_resident[1])
    peak = 0
    for s in range(12):
        _step(policy, s)
        _step(ref_policy, s)
        peak = max(peak, int(store.n_resident[1] + store.queued_recall[1].sum()) - prefill)
        store.flush()
        store.end_step()
        ref.end_step()
        for h in [(0, 1), (1, 0), (1, 1)]:
            assert resident_positions(store, *h) == resident_positions(ref, *h), (s, h)
    assert peak == room[1]  # disjoint windows, step after step: the room is reached, never exceeded


def test_triton_store_falls_back_to_the_pytorch_swap():
    """The one-launch Triton chunk swap has no window: with `fixed_window` the policy decides with the PyTorch
    kernels (one warning line) and the Triton store's moves hold what the reference store holds."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (optional `gpu` extra)")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported without TRITON_INTERPRET=1")
    with pytest.warns(UserWarning, match="method.fixed_window runs the chunk swap with the PyTorch kernels"):
        policy, store = _setup(functools.partial(PackedAudioKVStore, kernels="triton"), fixed_window=4)
    assert policy.on_device and policy._fused_swap is None
    ref_policy, ref = _setup(AudioKVStore, fixed_window=4)
    for s in range(6):
        _step(policy, s)
        _step(ref_policy, s)
        store.flush()
        store.end_step()
        ref.end_step()
        for h in [(0, 1), (1, 0), (1, 1)]:
            assert resident_positions(store, *h) == resident_positions(ref, *h), (s, h)


def test_one_row_less_and_the_store_refuses_the_window():
    policy, store = _setup(PackedAudioKVStore, fixed_window=4, room_delta=-1)
    with pytest.raises(RuntimeError, match="region is full"):
        for s in range(12):
            _step(policy, s)
            store.flush()
            store.end_step()


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_bad_window_is_refused_in_one_line(bad):
    with pytest.raises(ValueError, match=r"^method.fixed_window=.*: a number of segments >= 0 \(0: off\)"):
        WnW(scores=scores_for(np.ones((1, 2)), np.ones((1, 2))), fixed_window=bad)


def test_window_needs_the_peak_budget():
    with pytest.raises(ValueError, match="needs method.recall_budget=peak"):
        WnW(scores=scores_for(np.ones((1, 2)), np.ones((1, 2))), fixed_window=2, recall_budget="expected")
