"""`method.max_recalled`: a cap on the segments the chunk swap holds recalled, paid for in the peak lambda solve.

Checked against a reference written here as plain loops (the paper's swap, then the early releases one segment at a
time), independently of `ChunkSwap`'s arrays; the device swap and the one-launch Triton swap against the host one; the peak bound and the
packed store's room with the cap; the knob's validation.
"""

import functools
import math

import numpy as np
import pytest
import torch
from helpers import (needs_triton_interpreter, one_launch_swaps, placed_two_layer_sample, resident_positions,
                     scores_for)

from wnw_exp.kv.packed import PackedAudioKVStore
from wnw_exp.kv.reference import AudioKVStore
from wnw_exp.methods.wnw import WnW, triage


class _RefSwap:
    """The swap of §2.3 with the cap, one segment and one step at a time."""

    def __init__(self, n_audio, n_s, n_c, top_k, delta, cap):
        self.n_audio, self.n_s, self.n_c, self.top_k, self.delta, self.cap = n_audio, n_s, n_c, top_k, delta, cap
        self.chunks = [(s, min(s + n_c, n_audio)) for s in range(0, n_audio, n_s)]
        while len(self.chunks) > 1 and self.chunks[-2][1] >= n_audio:  # the last chunk that reaches the end
            self.chunks.pop()
        self.n_seg = math.ceil(n_audio / n_s)
        self.recalled, self.idle_for = set(), {}

    def step(self, a):
        a = [float(x) for x in a]
        mean = [sum(a[s:e]) / (e - s) for s, e in self.chunks]
        order = sorted(range(len(mean)), key=lambda c: (-mean[c], c))[: self.top_k]
        wanted = {g for c in order for g in range(self.chunks[c][0] // self.n_s, (self.chunks[c][1] - 1) // self.n_s + 1)}
        recall = sorted(wanted - self.recalled)
        release = []
        for g in sorted(self.recalled | wanted):
            if g in wanted:
                self.idle_for[g] = 0
            else:
                self.idle_for[g] += 1
                if self.idle_for[g] >= self.delta:
                    release.append(g)
        self.recalled = (self.recalled | wanted) - set(release)
        while self.cap and len(self.recalled) > self.cap:
            def seg_mean(g):
                s, e = g * self.n_s, min((g + 1) * self.n_s, self.n_audio)
                return sum(a[s:e]) / (e - s)
            g = max(self.recalled - wanted, key=lambda g: (self.idle_for[g], -seg_mean(g), -g))
            self.recalled.discard(g)
            release.append(g)
        for g in release:
            self.idle_for[g] = 0
        return sorted(order), recall, sorted(release)


def _inputs(n_audio, steps, seed):
    """Anchor attention that wanders (a random walk of peaks), jumps, ties (zeros) and stays put."""
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        if step % 9 == 4:
            yield torch.zeros(n_audio)
        elif step % 5 == 0:
            a = torch.full((n_audio,), 1e-4)
            at = int(torch.randint(0, n_audio, (1,), generator=g))
            a[at:at + 40] = 1.0
            yield a
        else:
            yield torch.softmax(torch.randn(n_audio, generator=g) * 3, 0).float()


CASES = [(1000, 25, 50, 3, 3, 6), (1000, 25, 50, 3, 3, 9), (1037, 25, 30, 2, 1, 4), (400, 10, 20, 1, 4, 3),
         (110, 25, 50, 3, 3, 6)]


@pytest.mark.parametrize("n_audio,n_s,n_c,top_k,delta,cap", CASES)
def test_capped_swap_matches_the_loop_reference(n_audio, n_s, n_c, top_k, delta, cap):
    ref = _RefSwap(n_audio, n_s, n_c, top_k, delta, cap)
    host = triage.ChunkSwap(n_audio, n_s, n_c, top_k, delta, max_recalled=cap)
    early = 0
    for step, a in enumerate(_inputs(n_audio, 60, seed=n_audio + cap)):
        got, want = host.step(a.clone()), ref.step(a)
        assert got == want, step
        assert set(np.flatnonzero(host.recalled).tolist()) == ref.recalled
        assert host.recalled.sum() <= cap
        early += len(got[2])
    assert early > 0


@pytest.mark.parametrize("n_audio,n_s,n_c,top_k,delta,cap", CASES)
def test_device_swap_applies_the_cap_as_the_host_one(n_audio, n_s, n_c, top_k, delta, cap):
    host = triage.ChunkSwap(n_audio, n_s, n_c, top_k, delta, max_recalled=cap)
    dev = triage.DeviceChunkSwap(n_audio, n_s, n_c, top_k, delta, torch.device("cpu"), max_recalled=cap)
    for step, a in enumerate(_inputs(n_audio, 60, seed=7 * n_audio + cap)):
        selected, recall, release = host.step(a.clone())
        d_sel, d_rec, d_rel = dev.step(a.clone())
        assert d_sel.nonzero().flatten().tolist() == selected, step
        assert d_rec.nonzero().flatten().tolist() == recall, step
        assert d_rel.nonzero().flatten().tolist() == release, step
        assert dev.recalled.numpy().tolist() == host.recalled.tolist()


def test_the_cap_shrinks_the_peak_room_and_raises_lambda():
    n_a, n_s, n_c = 1500, 25, 50  # 60 segments; paper: (delta + 1) * 3 * 2 = 24 held at the peak
    assert triage.peak_recalled_segments(n_a, n_s, n_c, 3, 3) == 24
    assert triage.peak_recalled_segments(n_a, n_s, n_c, 3, 3, max_recalled=6) == 12  # the cap + one selection
    assert triage.peak_recalled_segments(n_a, n_s, n_c, 3, 3, max_recalled=30) == 24  # a cap above the rule's most
    assert triage.resident_segment_bounds(n_a, n_s, n_c, 3, 3, max_recalled=6) == (4, 6)
    assert triage.smallest_recall_cap(3, n_c, n_s) == 6
    importance = np.array([[1.0, 0.6, 0.5, 0.45, 0.42, 0.41], [0.4, 0.3, 0.2, 0.15, 0.1, 0.05]])
    roles = triage.assign_roles(importance, 4, 1)  # 1 anchor, 3 tidal, 8 fixed
    s = triage.normalised_scores(importance, roles)
    lam = {segs: triage.solve_peak_lambda(s, roles, n_a, n_s, 0.4, segs).lam for segs in (24, 12)}
    assert lam[12] > lam[24]
    peak = triage.peak_r_gpu(triage.retentions(s, roles, lam[12]), roles, n_a, n_s, 12)
    assert peak <= 0.4


N_AUDIO, N_S = 400, 10  # 40 segments, chunks of 20 tokens every 10


def _setup(store_cls, cap, room_delta=0):
    scores = scores_for([[1.0, 0.2], [0.1, 0.5]], np.ones((2, 2)))  # anchor (0,0), tidal (0,1), (1,0), (1,1)
    policy = WnW(scores=scores, n_voice=4, n_anchor=1, lam=0.3, chunk_seconds=1.6, stride_seconds=0.8, top_k=2,
                 delta=3, max_recalled=cap)
    return placed_two_layer_sample(policy, store_cls, N_AUDIO, 0.5, room_delta)


def _step(policy, s):
    p = torch.full((2, N_AUDIO), 1e-4)
    at = [0, 300, 60, 360, 200, 20, 280, 120, 240, 160][s % 10]  # far apart, jumping back and forth
    p[:, at:at + 20] = 0.05
    p[:, (at + 170) % 380:(at + 170) % 380 + 20] = 0.04
    policy.observe(0, p)
    policy.after_step(s)


def test_packed_store_holds_what_the_reference_holds_within_the_capped_room():
    policy, store = _setup(PackedAudioKVStore, cap=4)
    ref_policy, ref = _setup(AudioKVStore, cap=4)
    assert policy.peak_segments == 8 and policy.knobs()["max_recalled"] == 4
    room = policy.recall_headroom
    prefill = store.n_resident.clone()
    peak = torch.zeros_like(prefill)
    for s in range(14):
        _step(policy, s)
        _step(ref_policy, s)
        assert policy.swap.recalled.sum() <= 4 if not policy.on_device else policy.device_swap.recalled.sum() <= 4
        peak = torch.maximum(peak, store.n_resident + store.queued_recall.sum(dim=1) - prefill)
        store.flush()
        store.end_step()
        ref.end_step()
        for h in [(0, 1), (1, 0), (1, 1)]:
            assert resident_positions(store, *h) == resident_positions(ref, *h), (s, h)
    assert (peak.numpy() <= room).all() and (peak.numpy() == room)[room > 0].any()  # reached, never exceeded
    with pytest.raises(RuntimeError, match="region is full"):
        policy, store = _setup(PackedAudioKVStore, cap=4, room_delta=-1)
        for s in range(14):
            _step(policy, s)
            store.flush()
            store.end_step()


@pytest.mark.parametrize("n_audio,n_s,n_c,top_k,delta,cap", CASES[:3])
def test_one_launch_swap_applies_the_cap_as_the_host_one(n_audio, n_s, n_c, top_k, delta, cap):
    """The Triton decision (on the GPU, or Triton's interpreter on the CPU), two streams in one launch, one with the
    cap and one without: each gives its host swap's chunks, recalls and releases at every step."""
    steps = 30
    hosts, parts, tables = one_launch_swaps(n_audio, n_s, n_c, top_k, delta,
                                            [dict(max_recalled=cap), dict(max_recalled=0)], steps)
    for step, a in enumerate(_inputs(n_audio, steps, seed=3 * n_audio + cap)):
        for _, scores in parts:
            scores.copy_(a)
        tables.decide()
        for host, (fused, scores) in zip(hosts, parts):
            selected, recall, release = host.step(a.clone())
            assert fused.selected.nonzero().flatten().tolist() == selected, step
            assert fused.recall.nonzero().flatten().tolist() == recall, step
            assert fused.release.nonzero().flatten().tolist() == release, step
            assert fused.swap.recalled.cpu().numpy().tolist() == host.recalled.tolist()
            assert int(fused.records["resident"][step]) == int(host.recalled.sum()) and not scores.any()


def test_triton_store_holds_what_the_reference_holds():
    needs_triton_interpreter()
    policy, store = _setup(functools.partial(PackedAudioKVStore, kernels="triton"), cap=4)
    assert policy.on_device and policy._fused_swap is not None
    ref_policy, ref = _setup(AudioKVStore, cap=4)
    for s in range(8):
        _step(policy, s)
        _step(ref_policy, s)
        store.flush()
        store.end_step()
        ref.end_step()
        for h in [(0, 1), (1, 0), (1, 1)]:
            assert resident_positions(store, *h) == resident_positions(ref, *h), (s, h)


@pytest.mark.parametrize("bad", [-1, 1.5, "6", True, 5])
def test_bad_cap_is_refused_in_one_line(bad):
    with pytest.raises(ValueError, match=r"^method.max_recalled=.*: 0 \(no cap, the paper\) or a number of segments >= 6"):
        WnW(scores=scores_for(np.ones((1, 2)), np.ones((1, 2))), max_recalled=bad)
