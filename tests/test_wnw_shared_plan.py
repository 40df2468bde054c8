"""WnW's per-request setup: solved once per (sample length, target, settings), shared by the forks, exactly as before.

`WnW.start` takes its triage, lambda and r_GPU figures from `_solution`, a cache the policy shares with its forks
(`Policy.fork`), so the streams of a batch with the same audio length solve once; the solve itself and the host
reads after placement (`offloaded`, `recall_headroom`, the host-tier pairs) work on all heads at once. The reference
here is `start` written out plainly from the per-head functions: `kept_per_head` summed head by head, each tidal
head's recall room from its own `segment_quotas`, the tidal heads demoted one at a time, the full 100-step
bisection. Every figure must be the same, bit for bit, on short clips (demotions), long ones, both recall budgets,
both selections and both quotas; a fork's cached solution must equal a fresh policy's.
"""

import numpy as np
import pytest
import torch
from helpers import scores_for

from wnw_exp.engine.decode import place
from wnw_exp.kv.packed import PackedAudioKVStore
from wnw_exp.methods.base import PrefillScores, SampleContext
from wnw_exp.methods.wnw import WnW, triage
from wnw_exp.methods.wnw import policy as wnw_policy

A, T = triage.ANCHOR, triage.TIDAL
L, H, G = 6, 4, 2
RNG = np.random.default_rng(7)
VS, HS = RNG.beta(2, 20, (L, H)), RNG.lognormal(-11, 1, (L, H))
CASES = [(37, 0.2), (203, 0.2), (1000, 0.2), (1000, 0.4), (3000, 0.2)]  # 37 tokens: one chunk, tidal heads demoted


def ctx_for(n_audio: int, retention: float) -> SampleContext:
    return SampleContext(n_layers=L, n_q_heads=H * G, n_kv_heads=H, head_dim=4, token_rate=12.5, n_audio=n_audio,
                         retention=retention, device=torch.device("cpu"))


def store_for(n_audio: int) -> PackedAudioKVStore:
    return PackedAudioKVStore(L, H, 4, n_audio, torch.device("cpu"), torch.float32, dense_capacity=4, kernels="torch")


def wnw(**kw) -> WnW:
    return WnW(scores=scores_for(VS, HS), **kw)


# --- the plain per-head reference -------------------------------------------------------------------------------
def plain_prefill(ret, roles, n, n_s, quota):
    kept = sum(n if role == A else triage.kept_per_head(float(r), n, n_s, quota=quota)
               for r, role in zip(ret.ravel(), roles.ravel()))
    return kept / (roles.size * n)


def plain_room(ret, roles, n, n_s, segments, selection, quota) -> int:
    length = np.array([e - s for s, e in triage.segment_bounds(n, n_s)])
    total = 0
    for r, role in zip(ret.ravel(), roles.ravel()):
        if role != T:
            continue
        if selection == "global":
            most = np.sort(length)[::-1][:segments].sum()
            total += min(n - triage.kept_per_head(float(r), n, n_s, quota=quota), most)
        else:
            kept = length if r >= 1 else triage.segment_quotas(float(r), n, n_s, quota)
            total += sum(sorted(length - kept, reverse=True)[:segments])
    return int(total)


def plain_peak(ret, roles, n, n_s, segments, selection, quota):
    return plain_prefill(ret, roles, n, n_s, quota) + plain_room(ret, roles, n, n_s, segments, selection, quota) / (
        roles.size * n)


def plain_expected(ret, roles, n, n_s, fraction, quota):
    missing = sum(n - triage.kept_per_head(float(r), n, n_s, quota=quota)
                  for r, role in zip(ret.ravel(), roles.ravel()) if role == T)
    return plain_prefill(ret, roles, n, n_s, quota) + (fraction * missing / (roles.size * n) if fraction else 0.0)


def plain_start(p: WnW, ctx: SampleContext) -> dict:
    """`WnW.start`'s figures from the per-head formulas, head by head, without any cache."""
    roles, s, _, _ = p.triage_for(ctx.retention)
    n, target = ctx.n_audio, ctx.retention
    n_c, n_s = triage.swap_sizes(ctx.token_rate, p.chunk_seconds, p.stride_seconds)
    segs = triage.peak_recalled_segments(n, n_s, n_c, p.top_k, p.delta)
    peak = lambda ret, rl: plain_peak(ret, rl, n, n_s, segs, p.selection, p.quota)  # noqa: E731
    if p.recall_budget == "peak":
        zero = np.where(roles == A, 1.0, 0.0)
        if peak(zero, roles) > target:
            roles = roles.copy()
            for i in np.argsort(p.importance.ravel(), kind="stable"):
                if roles.flat[i] == T:
                    roles.flat[i] = triage.FIXED
                    if peak(zero, roles) <= target:
                        break
    n_seg = -(-n // n_s)
    fraction = 0.0
    if p.recall_budget != "none":
        fraction = triage.expected_resident_segments(n, n_s, n_c, p.top_k, p.delta, p._mobility()[0]) / n_seg
    ret = lambda lam: triage.retentions(s, roles, lam)  # noqa: E731
    lam_max = 1.0 / s[(roles != A) & (s > 0)].min()
    lo, hi = 0.0, lam_max
    if p.recall_budget == "peak":
        if peak(ret(lam_max), roles) <= target:
            lam = lam_max
        else:
            for _ in range(100):
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if peak(ret(mid), roles) <= target else (lo, mid)
            lam = lo
    else:
        r = lambda lam: plain_expected(ret(lam), roles, n, n_s, fraction, p.quota)  # noqa: E731
        if r(lam_max) <= target:
            lam = lam_max
        elif r(0.0) >= target:
            lam = 0.0
        else:
            for _ in range(100):
                mid = 0.5 * (lo + hi)
                lo, hi = (lo, mid) if r(mid) >= target else (mid, hi)
            lam = lo if target - r(lo) < r(hi) - target else hi
    x = ret(lam)
    return dict(lam=lam, roles=roles, retention=x, prefill_r_gpu=plain_prefill(x, roles, n, n_s, p.quota),
                expected_r_gpu=plain_expected(x, roles, n, n_s, fraction, p.quota),
                peak_r_gpu=peak(x, roles), n_s=n_s, n_c=n_c, peak_segments=segs)


def figures(p: WnW) -> dict:
    return {k: getattr(p, k) for k in ("lam", "roles", "retention", "prefill_r_gpu", "expected_r_gpu", "peak_r_gpu",
                                       "n_s", "n_c", "peak_segments")}


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, np.ndarray):
            assert np.array_equal(got[k], v), k
        else:
            assert got[k] == v, (k, got[k], v)  # exactly: the same float operations


# --- the solution ------------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:lambda")
@pytest.mark.parametrize("quota", ["floor", "spread"])
@pytest.mark.parametrize("selection", ["segment", "global"])
@pytest.mark.parametrize("budget", ["peak", "expected"])
def test_solution_equals_the_plain_per_head_start(budget, selection, quota):
    parent = wnw(recall_budget=budget, selection=selection, quota=quota)
    demoted = 0
    for n, r in CASES + CASES[::-1]:  # the second pass is served from the cache
        p = parent.fork()
        p.start(ctx_for(n, r), store_for(n))
        want = plain_start(p, p.ctx)
        assert_same(figures(p), want)
        assert p.lam > 0 or (budget == "expected" and n < 1000)  # short clips' expected recall alone: lambda 0
        if budget == "peak":
            assert p.peak_r_gpu <= r
        demoted += p.n_demoted
    assert len(parent._solutions) == len(CASES)
    assert (demoted > 0) == (budget == "peak")  # the short clip's tidal heads do not fit beside the anchors


def test_a_forks_cached_solution_is_a_fresh_policys(monkeypatch):
    solves = []
    solve = triage.solve_peak_lambda
    monkeypatch.setattr(triage, "solve_peak_lambda", lambda *a, **kw: solves.append(a[2]) or solve(*a, **kw))
    parent = wnw()
    parent.check(0.2)
    a, b = parent.fork(), parent.fork()
    a.start(ctx_for(1000, 0.2), store_for(1000))
    b.start(ctx_for(1000, 0.2), store_for(1000))
    assert solves == [1000] and a._solutions is b._solutions is parent._solutions  # one solve for both streams
    fresh = wnw()
    fresh.start(ctx_for(1000, 0.2), store_for(1000))
    assert solves == [1000, 1000]  # a fresh policy solves on its own
    for p in (a, b):
        assert_same(figures(p), figures(fresh))
        assert (p.anchor_q, p.tidal, p.n_demoted, p.knobs()) == (fresh.anchor_q, fresh.tidal, fresh.n_demoted,
                                                                   fresh.knobs())
    assert a.roles is b.roles and not a.roles.flags.writeable and not a.retention.flags.writeable
    assert a.scores_acc is not b.scores_acc and a.swap is not b.swap and a.device_swap is not b.device_swap
    b.start(ctx_for(203, 0.2), store_for(203))  # another length: solved, the same as a fresh policy's
    fresh.start(ctx_for(203, 0.2), store_for(203))
    assert solves == [1000, 1000, 203, 203]
    assert_same(figures(b), figures(fresh))
    a.start(ctx_for(1000, 0.4), store_for(1000))  # another target
    assert solves[-1] == 1000 and len(parent._solutions) == 3


def test_solutions_keep_the_most_recent(monkeypatch):
    monkeypatch.setattr(wnw_policy._Solutions, "size", 2)
    p = wnw()
    for n in (203, 1000, 203, 3000):
        p.start(ctx_for(n, 0.2), store_for(n))
    assert [k[0] for k in p._solutions] == [203, 3000]  # 1000, the least recently used, went


def test_kept_counts_is_kept_per_head():
    ret = np.array([0.0, 0.01, 0.039, 0.04, 0.2, 1 / 3, 0.5, 0.999999, 1.0, 1.5, 0.2 * 3, 0.1 + 0.2])
    for n, n_s in ((1000, 25), (203, 10), (37, 25), (24, 25), (3000, 25)):
        for quota in ("floor", "spread"):
            want = [triage.kept_per_head(float(r), n, n_s, quota=quota) for r in ret]
            assert triage.kept_counts(ret, n, n_s, quota).tolist() == want
            assert triage.kept_counts(ret.reshape(3, 4), n, n_s, quota).ravel().tolist() == want


# --- after placement ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("selection", ["segment", "global"])
def test_host_tier_reads_equal_the_per_head_formulas(selection):
    n = 3000  # no tidal head demoted
    p = wnw(selection=selection)
    store = store_for(n)
    p.start(ctx_for(n, 0.2), store)
    g = torch.Generator().manual_seed(3)
    keeps = {}
    for li in range(L):
        k = torch.randn(H, n + 5, 4, generator=g)
        store.write_prefill(li, k, k, (2, 2 + n))
        post = torch.randint(0, 4, (H * G, 3, n), generator=g).float()  # ties: the earlier position wins
        per_head = post.sum(dim=1).view(H, G, -1).sum(dim=1)
        for h in range(H):
            if p.roles[li, h] == T and p.retention[li, h] < 1:
                keeps[(li, h)] = triage.select_positions(per_head[h], float(p.retention[li, h]), p.n_s, selection)
        place(p, p.store, li, PrefillScores(post))
        if li == 2:
            assert len(p.offloaded) > 0  # read part-way: the later layers' masks are read at the next read
    off = p.offloaded
    assert list(off) == list(keeps) and len(off) == (p.roles == T).sum() == 7
    for key, kept in keeps.items():
        assert torch.equal(off[key], triage.complement(kept, n)), key
    # recall_headroom: each tidal head's `peak_segments` largest per-segment host-tier counts, head by head
    room = np.zeros(L * H, np.int64)
    for (li, h), pos in off.items():
        room[li * H + h] = np.sort(np.bincount(pos.numpy() // p.n_s, minlength=-(-n // p.n_s)))[::-1][
            : p.peak_segments].sum()
    assert np.array_equal(p.recall_headroom, room) and room.any()
    if selection == "segment":  # the placed counts are the quotas: the room is `triage.recall_room`'s
        assert np.array_equal(room.reshape(L, H), triage.recall_room(p.retention, p.roles, n, p.n_s,
                                                                     p.peak_segments))
    # the device swap's (row, position, segment) pairs, head by head
    rows, pos, seg = p._host_pairs()
    want_rows = torch.cat([torch.full((len(c),), li * H + h) for (li, h), c in off.items()])
    want_pos = torch.cat(list(off.values()))
    for got, want in ((rows, want_rows), (pos, want_pos), (seg, want_pos // p.n_s)):
        assert got.dtype == torch.long and torch.equal(got, want)
