"""`method.locality`: the chunks a chunk-swap decision selects besides the anchors' focus stay near it.

Checked against a selection written here as a plain sort (the focus first, then the nearest-enough chunks by mean,
ties to the earlier chunk), independently of `ChunkSwap`'s arrays; the device swap and the one-launch Triton swap (on
the GPU, or in Triton's interpreter on the CPU) against the host one, with and without the cap; the knob's validation.
"""


import numpy as np
import pytest
import torch
from helpers import one_launch_swaps, placed_two_layer_sample, resident_positions, scores_for

from wnw_exp.methods.wnw import WnW, triage


def _chunks(n_audio, n_s, n_c):
    chunks = [(s, min(s + n_c, n_audio)) for s in range(0, n_audio, n_s)]
    while len(chunks) > 1 and chunks[-2][1] >= n_audio:  # the last chunk that reaches the end
        chunks.pop()
    return chunks


def _ref_select(a, chunks, top_k, locality):
    a = [float(x) for x in a]
    mean = [sum(a[s:e]) / (e - s) for s, e in chunks]
    order = sorted(range(len(mean)), key=lambda c: (-mean[c], c))
    focus = order[0]
    if locality:
        order = [c for c in order if abs(c - focus) <= locality]
    return sorted(order[:top_k])


def _inputs(n_audio, steps, seed):
    """Anchor attention with a moving peak and a second, far one (the distractor the option keeps out), zeros
    (ties) and noise."""
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        if step % 11 == 5:
            yield torch.zeros(n_audio)
        elif step % 3 == 0:
            yield torch.softmax(torch.randn(n_audio, generator=g) * 3, 0).float()
        else:
            a = torch.full((n_audio,), 1e-4)
            at = (step * 7) % max(1, n_audio - 40)
            a[at:at + 30] = 1.0
            far = int(torch.randint(0, n_audio, (1,), generator=g))
            a[far:far + 12] = 0.9
            yield a


CASES = [(1000, 25, 50, 3, 3, 2, 0), (1000, 25, 50, 3, 3, 4, 6), (1037, 25, 30, 2, 1, 1, 4), (400, 10, 20, 1, 4, 3, 0),
         (110, 25, 50, 3, 3, 2, 6)]


@pytest.mark.parametrize("n_audio,n_s,n_c,top_k,delta,loc,cap", CASES)
def test_host_swap_selects_near_the_focus(n_audio, n_s, n_c, top_k, delta, loc, cap):
    chunks = _chunks(n_audio, n_s, n_c)
    host = triage.ChunkSwap(n_audio, n_s, n_c, top_k, delta, max_recalled=cap, locality=loc)
    free = triage.ChunkSwap(n_audio, n_s, n_c, top_k, delta, max_recalled=cap)
    differ = 0
    for step, a in enumerate(_inputs(n_audio, 60, seed=n_audio + loc)):
        got = host.step(a.clone())[0]
        assert got == _ref_select(a, chunks, top_k, loc), step
        assert all(abs(c - host.focus) <= loc for c in got)
        differ += got != free.step(a.clone())[0]
    assert differ > 0 or top_k == 1 or len(chunks) <= loc + 1  # the far chunk is kept out where it would enter


@pytest.mark.parametrize("n_audio,n_s,n_c,top_k,delta,loc,cap", CASES)
def test_device_swap_selects_as_the_host_one(n_audio, n_s, n_c, top_k, delta, loc, cap):
    host = triage.ChunkSwap(n_audio, n_s, n_c, top_k, delta, max_recalled=cap, locality=loc)
    dev = triage.DeviceChunkSwap(n_audio, n_s, n_c, top_k, delta, torch.device("cpu"), max_recalled=cap, locality=loc)
    for step, a in enumerate(_inputs(n_audio, 60, seed=7 * n_audio + loc)):
        selected, recall, release = host.step(a.clone())
        d_sel, d_rec, d_rel = dev.step(a.clone())
        assert d_sel.nonzero().flatten().tolist() == selected, step
        assert d_rec.nonzero().flatten().tolist() == recall, step
        assert d_rel.nonzero().flatten().tolist() == release, step
        assert int(dev.top[0]) == host.focus


@pytest.mark.parametrize("n_audio,n_s,n_c,top_k,delta,loc,cap", CASES[:3])
def test_one_launch_swap_selects_as_the_host_one(n_audio, n_s, n_c, top_k, delta, loc, cap):
    """Two streams in one launch, one with the option and one without."""
    steps = 30
    hosts, parts, tables = one_launch_swaps(n_audio, n_s, n_c, top_k, delta,
                                            [dict(max_recalled=cap, locality=loc), dict(max_recalled=cap)], steps)
    for step, a in enumerate(_inputs(n_audio, steps, seed=3 * n_audio + loc)):
        for _, scores in parts:
            scores.copy_(a)
        tables.decide()
        for host, (fused, scores) in zip(hosts, parts):
            selected, recall, release = host.step(a.clone())
            assert fused.selected.nonzero().flatten().tolist() == selected, step
            assert fused.recall.nonzero().flatten().tolist() == recall, step
            assert fused.release.nonzero().flatten().tolist() == release, step


def test_the_knob_reaches_the_swap_and_the_knobs():
    policy = WnW(scores=scores_for(np.ones((1, 2)), np.ones((1, 2))), locality=2)
    assert policy.locality == 2
    assert triage.ChunkSwap(1000, 25, 50, 3, 3, locality=2).locality == 2


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True, 1])
def test_bad_locality_is_refused_in_one_line(bad):
    with pytest.raises(ValueError, match=r"^method.locality=.*: 0 \(off, the paper\) or .* >= top_k - 1 = 2$"):
        WnW(scores=scores_for(np.ones((1, 2)), np.ones((1, 2))), locality=bad)


N_AUDIO, N_S = 400, 10  # 40 segments, chunks of 20 tokens every 10


def _setup(store_cls, locality):
    scores = scores_for([[1.0, 0.2], [0.1, 0.5]], np.ones((2, 2)))  # anchor (0,0), tidal (0,1), (1,0), (1,1)
    policy = WnW(scores=scores, n_voice=4, n_anchor=1, lam=0.3, chunk_seconds=1.6, stride_seconds=0.8, top_k=2,
                 delta=3, max_recalled=4, locality=locality)
    return placed_two_layer_sample(policy, store_cls, N_AUDIO, 0.5)


def _step(policy, s):
    """The anchor reads forward from token 40 (chunk 4 on), with a weaker peak 170 tokens further on."""
    p = torch.full((2, N_AUDIO), 1e-4)
    at = 40 + 10 * s
    p[:, at:at + 20] = 0.05
    p[:, at + 170:at + 190] = 0.04
    policy.observe(0, p)
    policy.after_step(s)


@pytest.mark.parametrize("locality", [0, 2])
def test_policy_on_the_packed_store_holds_what_the_reference_holds(locality):
    """End to end through the policy: the packed store (device swap) and the reference store (host swap) hold the same
    positions at every step; with the window the far peak's segments are never recalled, without it they are."""
    from wnw_exp.kv.packed import PackedAudioKVStore
    from wnw_exp.kv.reference import AudioKVStore

    policy, store = _setup(PackedAudioKVStore, locality)
    ref_policy, ref = _setup(AudioKVStore, locality)
    assert policy.on_device and not ref_policy.on_device and policy.knobs().get("locality", 0) == locality
    far_recalled = False
    for s in range(10):
        _step(policy, s)
        _step(ref_policy, s)
        far_recalled |= any(g >= (40 + 10 * s + 170) // N_S - 1 for g in np.flatnonzero(ref_policy.swap.recalled))
        store.flush()
        store.end_step()
        ref.end_step()
        for h in [(0, 1), (1, 0), (1, 1)]:
            assert resident_positions(store, *h) == resident_positions(ref, *h), (s, h)
    assert far_recalled == (locality == 0)
