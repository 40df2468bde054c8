"""WnW: triage, the lambda solver, prefill selection, the chunk-swap state machine, and the Full limit."""


import numpy as np
import pytest
import torch

from helpers import needs_triton_interpreter, noise_audio, scores_for, tiny_voxtral
from wnw_exp.engine.decode import place
from wnw_exp.methods.wnw import triage
from wnw_exp.head_scores import HeadScoresError
from wnw_exp.engine.serve import generate
from wnw_exp.kv.reference import AudioKVStore
from wnw_exp.methods import build_policy
from wnw_exp.methods.base import Policy, PrefillScores, SampleContext
from wnw_exp.methods.wnw import DEFAULT_MOBILITY, WnW

A, T, F = triage.ANCHOR, triage.TIDAL, triage.FIXED


# --- triage ------------------------------------------------------------------------------------------
VS = np.array([[0.9, 0.1, 0.5], [0.2, 0.8, 0.3]])
HS = np.array([[1.0, 5.0, 1.0], [4.0, 0.5, 2.0]])


def test_triage_on_given_scores():
    score = triage.importance(VS, HS)  # [[.9 .5 .5] [.8 .4 .6]]
    roles = triage.assign_roles(score, n_voice=4, n_anchor=2)
    # order: .9 (0,0), .8 (1,0), .6 (1,2), .5 (0,1) before .5 (0,2) by index
    assert roles.tolist() == [[A, T, F], [A, F, T]]
    assert triage.assign_roles(triage.importance(VS, HS, "vs"), 3, 1).tolist() == [[A, F, T], [F, T, F]]
    assert triage.assign_roles(triage.importance(VS, HS, "hs"), 2, 1).tolist() == [[F, A, F], [T, F, F]]
    s = triage.normalised_scores(score, roles)  # max over non-anchors = .6
    np.testing.assert_allclose(s, [[1, .5 / .6, .5 / .6], [1, .4 / .6, 1]])
    np.testing.assert_allclose(triage.retentions(s, roles, 0.9), [[1, .75, .75], [1, .6, .9]])
    with pytest.raises(triage.TriageError, match="n_anchor"):
        triage.assign_roles(score, n_voice=2, n_anchor=3)
    with pytest.raises(ValueError, match="signal"):
        triage.importance(VS, HS, "bogus")


def test_default_head_counts_follow_section_3_4():
    assert [triage.default_n_voice(r, 240) for r in (0.2, 0.4, 0.6, 0.8)] == [90, 50, 30, 30]
    assert [triage.default_n_voice(r, 72) for r in (0.2, 0.4, 0.6, 0.8)] == [27, 15, 9, 9]
    assert triage.default_n_voice(0.1, 240) == 90 and triage.default_n_voice(0.3, 240) == 90
    assert [triage.default_n_anchor(r, 240) for r in (0.1, 0.2, 0.8)] == [5, 5, 5]
    assert [triage.default_n_anchor(r, 72) for r in (0.2, 0.4, 0.6, 0.8)] == [5, 5, 5, 5]
    assert triage.default_n_anchor(0.2, 12) == 1 and triage.default_n_voice(0.2, 12) == 5


def test_n_voice_all_makes_every_non_anchor_head_tidal():
    scores = scores_for(VS, HS)  # importance [[.9 .5 .5] [.8 .4 .6]]: anchors (0,0), (1,0)
    roles, _, n_voice, n_anchor = WnW(scores=scores, n_voice="all", n_anchor=2).triage_for(0.2)
    assert roles.tolist() == [[A, T, T], [A, T, T]] and (n_voice, n_anchor) == (6, 2)
    assert WnW(scores=scores, n_voice="6", n_anchor=2).triage_for(0.2)[0].tolist() == roles.tolist()
    for bad in ("most", 4.5, True, "-1"):
        with pytest.raises(ValueError, match=r"method.n_voice=.*: auto \(§3.4\), all \(every KV head a voice head\) "
                                             r"or a number of KV heads"):
            WnW(scores=scores, n_voice=bad)


# --- lambda --------------------------------------------------------------------------------------------
def test_lambda_solver_meets_target_with_segment_floors():
    rng = np.random.RandomState(0)
    score = rng.rand(4, 6)
    roles = triage.assign_roles(score, n_voice=8, n_anchor=2)
    s = triage.normalised_scores(score, roles)
    n_audio, n_s = 1037, 25  # a partial last segment of 12
    for target in (0.1, 0.2, 0.4, 0.6):
        sol = triage.solve_lambda(s, roles, n_audio, n_s, target)
        ret = triage.retentions(s, roles, sol.lam)
        kept = sum(n_audio if r == A else sum(int(np.floor(x * (e - b) + 1e-9)) for b, e in
                                              triage.segment_bounds(n_audio, n_s))
                   for x, r in zip(ret.ravel(), roles.ravel()))
        assert sol.r_gpu == pytest.approx(kept / (24 * n_audio))
        assert abs(sol.r_gpu - target) <= 0.005
    sol = triage.solve_lambda(s, roles, n_audio, n_s, 1.0)
    assert sol.saturated and sol.r_gpu == 1.0
    with pytest.raises(triage.TriageError, match="anchor"):
        triage.solve_lambda(s, roles, n_audio, n_s, 0.05)  # 2 anchors of 24 heads keep 8.3 %


def test_lambda_solver_budgets_for_the_expected_recall():
    score = np.arange(1, 13, dtype=float).reshape(3, 4)
    roles = triage.assign_roles(score, n_voice=5, n_anchor=1)
    s = triage.normalised_scores(score, roles)
    plain = triage.solve_lambda(s, roles, 1000, 25, 0.2)
    with_recall = triage.solve_lambda(s, roles, 1000, 25, 0.2, resident_fraction=0.3)
    assert with_recall.lam < plain.lam
    assert abs(with_recall.r_gpu - 0.2) <= 0.005
    ret = triage.retentions(s, roles, with_recall.lam)
    prefill = triage.prefill_r_gpu(ret, roles, 1000, 25)
    assert prefill < 0.2 - 0.01
    missing = sum(1000 - triage.kept_per_head(x, 1000, 25) for x, r in zip(ret.ravel(), roles.ravel()) if r == T)
    assert with_recall.r_gpu == pytest.approx(prefill + 0.3 * missing / (12 * 1000))
    with pytest.raises(ValueError, match="resident_fraction"):
        triage.solve_lambda(s, roles, 1000, 25, 0.2, resident_fraction=1.5)
    # 1 anchor (1/12 = 0.083) + 4 tidal heads recalling 40 % of everything they miss at lambda = 0 (0.133):
    # no lambda reaches 0.2; the closest is 0, with a warning, not an error blaming the anchors
    with pytest.warns(UserWarning, match="expected recall"):
        low = triage.solve_lambda(s, roles, 1000, 25, 0.2, resident_fraction=0.4)
    assert low.lam == 0.0 and low.r_gpu == pytest.approx(1 / 12 + 4 / 12 * 0.4)


# --- the expected decode-time recall ------------------------------------------------------------------
def test_resident_segment_bounds_by_hand():
    # 1000 tokens, n_s 25, n_c 50: 40 segments, 39 chunks of w = 2 segments; top 3, delta 3
    assert triage.resident_segment_bounds(1000, 25, 50, 3, 3) == (4, 18)  # 3 + 2 - 1, 3 * 3 * 2
    assert triage.resident_segment_bounds(1000, 25, 50, 1, 1) == (2, 2)  # one chunk, no lag: its 2 segments
    assert triage.resident_segment_bounds(1000, 25, 50, 2, 5) == (3, 20)
    assert triage.resident_segment_bounds(1000, 25, 30, 3, 3) == (4, 18)  # 30 tokens still straddle 2 segments
    assert triage.resident_segment_bounds(1000, 25, 20, 3, 3) == (3, 9)  # chunk inside its segment: w = 1
    assert triage.resident_segment_bounds(110, 25, 50, 3, 3) == (4, 5)  # 5 segments, 4 chunks: capped
    assert triage.resident_segment_bounds(60, 25, 50, 3, 3) == (3, 3)  # 2 chunks <= top 3: always everything
    assert triage.resident_segment_bounds(0, 25, 50, 3, 3) == (0, 0)
    assert triage.expected_resident_segments(1000, 25, 50, 3, 3, 0.5) == pytest.approx(11.0)
    assert triage.expected_resident_segments(1000, 25, 50, 3, 3, 0.0) == 4
    assert triage.expected_resident_segments(1000, 25, 50, 3, 3, 1.0) == 18
    assert triage.expected_resident_segments(110, 25, 50, 3, 3, 0.5) == pytest.approx(4.5)
    assert triage.mobility_of(11.0, 1000, 25, 50, 3, 3) == pytest.approx(0.5)
    assert triage.mobility_of(30.0, 1000, 25, 50, 3, 3) == 1.0 and triage.mobility_of(2.0, 1000, 25, 50, 3, 3) == 0.0
    assert triage.mobility_of(3.0, 60, 25, 50, 3, 3) is None
    with pytest.raises(ValueError, match="mobility"):
        triage.expected_resident_segments(1000, 25, 50, 3, 3, 1.2)


def test_the_bounds_are_what_the_chunk_swap_does():
    """Stationary attention holds R_min segments; k new disjoint chunks per step hold R_max after delta steps."""
    n_a, n_s, n_c, k, d = 1000, 25, 50, 3, 3
    lo, hi = triage.resident_segment_bounds(n_a, n_s, n_c, k, d)
    swap = triage.ChunkSwap(n_a, n_s, n_c, k, d)
    a = torch.zeros(n_a)
    a[250:300] = 1.0  # segments 10, 11: chunks 9, 10, 11 are the top 3 (10 has mean 1, 9 and 11 mean 0.5)
    for _ in range(6):
        swap.step(a)
        assert swap.recalled.sum() == lo == 4
    swap = triage.ChunkSwap(n_a, n_s, n_c, k, d)
    counts = []
    for step in range(8):
        a = torch.zeros(n_a)
        for i in range(k):  # chunk 4m = segments 4m, 4m + 1 (neighbours score 0.5); 9 consecutive m mod 10
            m = (k * step + i) % 10  # never repeat within 3 steps
            a[4 * m * n_s:(4 * m + 2) * n_s] = 1.0
        assert swap.step(a)[0] == sorted(4 * ((k * step + i) % 10) for i in range(k))
        counts.append(int(swap.recalled.sum()))
    assert counts == [6, 12] + [hi] * 6 and hi == 18


def test_expected_r_gpu_charges_only_what_tidal_heads_miss():
    roles = np.array([[A, T], [F, F]], dtype=object)
    ret = np.array([[1.0, 0.2], [0.0, 0.0]])
    # anchor 1000 + tidal 40 segments x floor(0.2 * 25) = 200 + fixed 0, over 4 heads x 1000
    assert triage.expected_r_gpu(ret, roles, 1000, 25) == pytest.approx(0.3)
    # mobility 0.5: 11 of 40 segments recalled, each brings back the tidal head's 20 missing positions
    frac = triage.expected_resident_segments(1000, 25, 50, 3, 3, 0.5) / 40
    assert triage.expected_r_gpu(ret, roles, 1000, 25, frac) == pytest.approx((1200 + 11 * 20) / 4000)
    # a fixed head's dropped positions are never recalled: charging them would be wrong
    assert triage.expected_r_gpu(np.array([[1.0, 0.2], [0.2, 0.0]]), roles, 1000, 25, frac) == \
        pytest.approx((1400 + 11 * 20) / 4000)
    # a tidal head at retention 1 misses nothing
    assert triage.expected_r_gpu(np.array([[1.0, 1.0], [0.0, 0.0]]), roles, 1000, 25, frac) == pytest.approx(0.5)


# --- prefill selection ------------------------------------------------------------------------------
def test_per_segment_and_global_selection():
    scores = torch.zeros(23)
    scores[[0, 1, 2, 3]] = torch.tensor([9.0, 8.0, 7.0, 6.0])  # all the mass in segment 0
    scores[[5, 9]] = torch.tensor([1.0, 2.0])
    scores[[11, 14]] = torch.tensor([3.0, 0.5])
    scores[[20, 22]] = torch.tensor([4.0, 5.0])  # last segment [20, 23): 3 tokens
    per_seg = triage.select_positions(scores, 0.4, 5, "segment")  # floor(0.4*5)=2 per segment, floor(1.2)=1 last
    assert per_seg.tolist() == [0, 1, 5, 9, 11, 14, 15, 16, 22]
    glob = triage.select_positions(scores, 0.4, 5, "global")  # same total (9), no quota
    assert len(glob) == 9 and glob.tolist() == [0, 1, 2, 3, 5, 9, 11, 20, 22]
    assert triage.select_positions(scores, 1.0, 5).tolist() == list(range(23))
    assert triage.select_positions(scores, 0.1, 5).tolist() == []
    assert triage.complement(per_seg, 23).tolist() == [2, 3, 4, 6, 7, 8, 10, 12, 13, 17, 18, 19, 20, 21]


def test_chunk_grid():
    assert triage.segment_bounds(110, 25) == [(0, 25), (25, 50), (50, 75), (75, 100), (100, 110)]
    assert triage.chunk_bounds(110, 50, 25) == [(0, 50), (25, 75), (50, 100), (75, 110)]
    assert triage.chunk_bounds(40, 50, 25) == [(0, 40)]
    assert triage.swap_sizes(12.5, 4.0, 2.0) == (50, 25) and triage.swap_sizes(25, 4.0, 2.0) == (100, 50)


# --- the chunk swap, step by step ------------------------------------------------------------------
def make_policy(n_audio=100, delta=3, swap_start="decode", store_cls=AudioKVStore, lag=1, dense_capacity=16):
    """2 layers x 2 KV heads (g=2): (0,0) anchor, (1,1) tidal, (0,1) fixed, (1,0) fixed; segments of 10
    tokens (stride 0.8 s at 12.5 tokens/s), chunks of 20 (1.6 s), top-1 chunk. The swap's steps are driven
    by hand (`swap_start="decode"`: no decision from the prompt's last row)."""
    vs = np.array([[1.0, 0.2], [0.1, 0.5]])
    policy = WnW(scores=scores_for(vs, np.ones((2, 2))), n_voice=2, n_anchor=1, lam=0.5, chunk_seconds=1.6,
                 stride_seconds=0.8, top_k=1, delta=delta, swap_start=swap_start, lag=lag)
    ctx = SampleContext(n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=4, token_rate=12.5, n_audio=n_audio,
                        retention=0.3, device=torch.device("cpu"))
    store = store_cls(2, 2, 4, n_audio, torch.device("cpu"), torch.float32, dense_capacity=dense_capacity)
    policy.start(ctx, store)
    torch.manual_seed(0)
    for layer in range(2):
        k = torch.randn(2, n_audio + 3, 4)
        store.write_prefill(layer, k, k + 1, (1, 1 + n_audio))
        # text-to-audio attention: the first positions of each segment score highest
        post = torch.linspace(1.0, 0.0, 10).repeat(n_audio // 10)[None, None].expand(4, 2, n_audio)
        place(policy, store, layer, PrefillScores(post.clone()))
    return policy, store


def focus(n_audio, chunk_start):
    """Anchor attention concentrated on one chunk."""
    p = torch.full((2, n_audio), 1e-4)
    p[:, chunk_start:chunk_start + 20] = 0.05
    return p


def gpu_positions(store, layer, head):
    return sorted(store.heads[layer][head].gpu_pos.tolist())


def test_roles_and_prefill_tiers():
    policy, store = make_policy()
    assert policy.roles.tolist() == [[A, F], [F, T]]
    assert policy.observe_heads(0) == [0, 1] and policy.observe_heads(1) == []
    assert len(gpu_positions(store, 0, 0)) == 100  # anchor: everything
    tidal = store.heads[1][1]
    # retention(1,1) = min(1 * 0.5, 1) = 0.5 -> top 5 of each 10-token segment: positions 0-4 of each
    assert gpu_positions(store, 1, 1) == [s + i for s in range(0, 100, 10) for i in range(5)]
    assert sorted(tidal.cpu_pos.tolist()) == [s + i for s in range(0, 100, 10) for i in range(5, 10)]
    # fixed heads: retention 0.5 * s~ (0.2/0.5 = 0.4 and 0.1/0.5 = 0.2) -> 2 and 1 per segment, rest dropped
    assert len(gpu_positions(store, 0, 1)) == 20 and len(store.heads[0][1].cpu_pos) == 0
    assert len(gpu_positions(store, 1, 0)) == 10 and len(store.heads[1][0].cpu_pos) == 0


def test_chunk_swap_recall_timing_delta_lag_and_cpu_copy():
    policy, store = make_policy(delta=3)
    prefill = gpu_positions(store, 1, 1)
    cpu_before = store.heads[1][1].cpu_pos.clone()
    seg = lambda s: list(range(10 * s + 5, 10 * s + 10))  # the CPU part of segment s  # noqa: E731

    def step(s, chunk_start):
        policy.observe(0, focus(100, chunk_start))
        policy.after_step(s)
        store.end_step()
        return set(gpu_positions(store, 1, 1)) - set(prefill)

    # step 0: chunk 3 = segments 3, 4 -> recalled right after the step (for step 1)
    assert step(0, 30) == set(seg(3) + seg(4))
    assert store.steps[-1].h2d_bytes == 10 * 4 * 4 * 2  # 10 positions, K and V, float32, D=4
    # the accumulator was reset: a new focus on chunk 5 (segments 5, 6) is not mixed with step 0's
    assert step(1, 50) == set(seg(3) + seg(4) + seg(5) + seg(6))
    assert policy.trace()["wnw"]["selected_chunks"] == [[3], [5]]
    # segments 3, 4 unselected at steps 1, 2, 3: released after the 3rd (delta = 3)
    assert step(2, 50) == set(seg(3) + seg(4) + seg(5) + seg(6))
    assert step(3, 50) == set(seg(5) + seg(6))
    assert policy.trace()["wnw"]["released_segments"][-1] == [3, 4]
    # the host copy persists: CPU tier unchanged, and the segment can be recalled again
    assert torch.equal(store.heads[1][1].cpu_pos, cpu_before)
    assert step(4, 40) == set(seg(4) + seg(5) + seg(6))  # chunk 4 = segments 4, 5: only 4 is new
    assert store.steps[-1].h2d_bytes == 5 * 4 * 4 * 2
    assert store.steps[-1].n_gpu_cpu == store.steps[0].n_gpu_cpu  # recall never changes r_GPU+CPU
    # prefill-selected positions are never released; fixed heads and anchors never move
    assert set(prefill) <= set(gpu_positions(store, 1, 1))
    assert len(gpu_positions(store, 0, 0)) == 100 and len(gpu_positions(store, 1, 0)) == 10


def test_no_recall_before_a_step_and_delta_one():
    policy, store = make_policy(delta=1)
    prefill = gpu_positions(store, 1, 1)
    policy.observe(0, focus(100, 0))
    policy.after_step(0)
    assert set(gpu_positions(store, 1, 1)) - set(prefill) == set(range(5, 10)) | set(range(15, 20))
    policy.observe(0, focus(100, 80))
    policy.after_step(1)  # delta = 1: segments 0, 1 go at once, 8, 9 come
    assert set(gpu_positions(store, 1, 1)) - set(prefill) == set(range(85, 90)) | set(range(95, 100))


# --- the Full limit ---------------------------------------------------------------------------------
def test_all_voice_heads_with_large_lambda_is_full_cache():
    backbone = tiny_voxtral()
    backbone.eos_token_ids = [-1]
    prompt = backbone.build_prompt(noise_audio(6.0))
    full = generate(backbone, prompt, Policy(), retention=1.0, max_new_tokens=32, keep_logits=True)
    vs = np.random.RandomState(1).rand(backbone.n_layers, backbone.n_kv_heads)
    n = vs.size
    wnw = WnW(scores=scores_for(vs, np.ones_like(vs), name="tiny_test", n_q_heads=backbone.n_q_heads),
              n_voice=n, n_anchor=5, lam=1e9, backbone_info=backbone.describe())
    ours = generate(backbone, prompt, wnw, retention=0.2, max_new_tokens=32, keep_logits=True)
    assert ours.tokens == full.tokens
    for a, b in zip(ours.logits, full.logits):
        assert torch.equal(a, b)
    assert ours.store_summary["r_gpu"] == 1.0 and ours.store_summary["mb_per_step"] == 0
    # the swap ran, with nothing to move: once from the prompt's last row, then after each of the 31 decode steps
    assert len(ours.trace["wnw"]["selected_chunks"]) == 1 + 31


def test_wnw_meets_the_prefill_target_on_a_tiny_model():
    backbone = tiny_voxtral()
    prompt = backbone.build_prompt(noise_audio(20.0))
    vs = np.random.RandomState(2).rand(backbone.n_layers, backbone.n_kv_heads)
    wnw = WnW(scores=scores_for(vs, np.ones_like(vs), name="tiny_test", n_q_heads=backbone.n_q_heads),
              recall_budget="none", backbone_info=backbone.describe())
    res = generate(backbone, prompt, wnw, retention=0.3, max_new_tokens=12)
    assert abs(wnw.prefill_r_gpu - 0.3) <= 0.005 and wnw.expected_r_gpu == wnw.prefill_r_gpu
    assert res.store_summary["r_gpu"] >= wnw.prefill_r_gpu - 1e-9
    assert res.store_summary["r_gpu_cpu"] > res.store_summary["r_gpu"]
    assert wnw.knobs()["n_anchor"] == 1 and wnw.knobs()["expected_resident_segments"] == 0


def test_wnw_budgets_each_samples_expected_recall():
    backbone = tiny_voxtral()
    vs = np.random.RandomState(2).rand(backbone.n_layers, backbone.n_kv_heads)
    scores = scores_for(vs, np.ones_like(vs), name="tiny_test", n_q_heads=backbone.n_q_heads)
    wnw = WnW(scores=scores, recall_budget="expected", mobility=0.5, backbone_info=backbone.describe())
    knobs = {}
    for seconds in (20.0, 60.0):
        generate(backbone, backbone.build_prompt(noise_audio(seconds)), wnw, retention=0.3, max_new_tokens=4)
        knobs[seconds] = k = wnw.knobs()
        assert k["mobility"] == 0.5 and k["mobility_source"] == "config"
        assert abs(k["expected_r_gpu"] - 0.3) <= 0.005 and k["prefill_r_gpu"] < k["expected_r_gpu"]
        n_a = wnw.ctx.n_audio
        assert k["expected_resident_segments"] == triage.expected_resident_segments(n_a, 25, 50, 3, 3, 0.5)
    # the encoder pads to 30 s: 375 tokens = 15 segments, capped below R_max = 18: 4 + 0.5 (15 - 4) = 9.5;
    # 60 s = 30 segments: 4 + 0.5 (18 - 4) = 11. The short clip recalls the larger share of its complement
    # (9.5 / 15 against 11 / 30), so its prefill gets less
    assert knobs[20.0]["expected_resident_segments"] == 9.5 and knobs[60.0]["expected_resident_segments"] == 11
    assert knobs[20.0]["prefill_r_gpu"] < knobs[60.0]["prefill_r_gpu"]


def test_mobility_comes_from_the_calibration_when_it_matches():
    vs = np.array([[1.0, 0.2], [0.1, 0.5]])
    measured = dict(value=0.2, signal="vs_hs", **triage.DEFAULT_SWAP)

    def mobility(policy: WnW) -> tuple[float, str]:
        """The mobility a sample runs with, and where it came from (set when the sample starts)."""
        ctx = SampleContext(n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=4, token_rate=12.5, n_audio=200,
                            retention=0.9, device=torch.device("cpu"))
        policy.start(ctx, AudioKVStore(2, 2, 4, 200, torch.device("cpu"), torch.float32, dense_capacity=16))
        return policy.mobility, policy.mobility_source

    assert mobility(WnW(scores=scores_for(vs, np.ones((2, 2)), swap_mobility=measured))) == (0.2, "calibration")
    assert mobility(WnW(scores=scores_for(vs, np.ones((2, 2)), swap_mobility=measured), delta=2)) == \
        (DEFAULT_MOBILITY, "default")
    assert mobility(WnW(scores=scores_for(vs, np.ones((2, 2)), swap_mobility=measured), mobility=0.7)) == \
        (0.7, "config")
    with pytest.raises(ValueError, match="mobility"):
        WnW(scores=scores_for(vs, np.ones((2, 2))), mobility=2)
    with pytest.raises(ValueError, match="recall_budget"):
        WnW(scores=scores_for(vs, np.ones((2, 2))), recall_budget="fraction")


def test_head_scale_spread_and_reading_size_shares_by_what_a_head_reads():
    """`head_scale: spread` gives s~ = VS x HS x audio_positions_90 normalised over the non-anchor heads, `reading`
    the audio share x audio_positions_90; the roles stay the importance's; a file without the measurement is
    refused in one line naming the fix."""
    vs = np.array([[1.0, 0.8], [0.6, 0.4], [0.3, 0.2]])
    hs = np.ones((3, 2))
    p90 = np.array([[0.01, 0.02], [0.30, 0.05], [0.10, 0.40]])
    audio = np.array([[0.9, 0.2], [0.1, 0.3], [0.7, 0.05]])
    kw = dict(n_voice=4, n_anchor=1, head_attention=dict(audio_positions_90=p90.tolist(), audio=audio.tolist()))
    base = WnW(scores=scores_for(vs, hs, **kw), n_voice=4, n_anchor=1)
    roles = base.triage_for(0.2)[0]
    for scale, signal in (("spread", vs * hs * p90), ("reading", audio * p90)):
        policy = WnW(scores=scores_for(vs, hs, **kw), n_voice=4, n_anchor=1, head_scale=scale)
        got_roles, s_tilde, _, _ = policy.triage_for(0.2)
        assert (got_roles == roles).all()
        other = roles != triage.ANCHOR
        want = signal[other] / signal[other].max()
        assert np.allclose(s_tilde[other], want) and (s_tilde[~other] == 1.0).all()
    # spread: head (1, 0) (VS 0.6, 90% of its mass on 30% of the positions) outranks head (0, 1) (VS 0.8, 2%)
    s_tilde = WnW(scores=scores_for(vs, hs, **kw), n_voice=4, n_anchor=1, head_scale="spread").triage_for(0.2)[1]
    assert s_tilde[1, 0] > s_tilde[0, 1]
    with pytest.raises(ValueError, match="head_scale=spread.*audio_positions_90.*wnw-calibrate"):
        WnW(scores=scores_for(vs, hs), head_scale="spread")
    with pytest.raises(ValueError, match="head_scale.*importance, flat, spread, reading"):
        WnW(scores=scores_for(vs, hs), head_scale="wide")


# --- the score file -----------------------------------------------------------------------------------
def test_mismatched_head_scores_are_refused(tmp_path):
    path = scores_for(VS, HS, name="voxtral").save(tmp_path / "head_scores.json")
    info = dict(name="qwen_omni", n_layers=36, n_q_heads=16, n_kv_heads=2, head_dim=128, token_rate=25.0)
    with pytest.raises(HeadScoresError, match="calibrated for model 'voxtral'.*uses model 'qwen_omni'.*wnw-calibrate"):
        build_policy(dict(name="wnw", head_scores=str(path)), info)
    with pytest.raises(HeadScoresError, match="no head-score file is shipped.*wnw-calibrate"):
        build_policy(dict(name="wnw", head_scores=None), dict(info, name="no_such_model"))
    ok = build_policy(dict(name="wnw", head_scores=str(path)),
                      dict(name="voxtral", n_layers=2, n_q_heads=6, n_kv_heads=3, head_dim=4, token_rate=12.5))
    assert ok.scores.voice_score.tolist() == VS.tolist()


# --- the per-segment quota: floor (§2.3) and spread -------------------------------------------------------
def test_segment_quotas_floor_and_spread():
    # retention 0.03 of 25-token segments: the floor keeps nothing; spread keeps floor(0.03 * 100) = 3
    assert triage.segment_quotas(0.03, 100, 25, "floor").tolist() == [0, 0, 0, 0]
    assert triage.segment_quotas(0.03, 100, 25, "spread").tolist() == [0, 1, 1, 1]  # floor(.03 * 25k) steps
    assert triage.kept_per_head(0.03, 100, 25, quota="floor") == 0
    assert triage.kept_per_head(0.03, 100, 25, quota="spread") == 3
    # a short last segment and a fraction above 1/n_s: every segment gets floor or ceil of ret * n_s
    q = triage.segment_quotas(0.3, 110, 25, "spread")
    assert q.sum() == 33 and set(q[:-1].tolist()) <= {7, 8} and q.tolist() == [7, 8, 7, 8, 3]
    assert triage.segment_quotas(0.3, 110, 25, "floor").tolist() == [7, 7, 7, 7, 3]
    scores = torch.arange(100.0).flip(0)  # earlier positions score higher
    keep = triage.select_positions(scores, 0.03, 25, "segment", "spread")
    assert keep.tolist() == [25, 50, 75]  # the best of segments 1, 2, 3
    assert len(triage.select_positions(scores, 0.03, 25, "segment", "floor")) == 0
    assert triage.select_positions(scores, 0.03, 25, "global", "spread").tolist() == [0, 1, 2]


def test_lambda_solver_counts_the_spread_quota():
    s = np.array([[1.0, 0.5, 0.01, 0.02]])
    roles = np.array([[triage.ANCHOR, triage.FIXED, triage.FIXED, triage.FIXED]], dtype=object)
    s_tilde = triage.normalised_scores(s, roles)
    for quota in triage.QUOTAS:
        sol = triage.solve_lambda(s_tilde, roles, 1000, 25, 0.3, quota=quota)
        ret = triage.retentions(s_tilde, roles, sol.lam)
        kept = 1000 + sum(triage.kept_per_head(float(r), 1000, 25, quota=quota) for r in ret[0, 1:])
        assert sol.r_gpu == pytest.approx(kept / 4000)
        assert abs(sol.r_gpu - 0.3) < 0.005
    # the low-score heads: under the floor they keep nothing, under spread their share of the audio
    sol = triage.solve_lambda(s_tilde, roles, 1000, 25, 0.3, quota="spread")
    ret = triage.retentions(s_tilde, roles, sol.lam)
    assert triage.kept_per_head(float(ret[0, 2]), 1000, 25, quota="floor") == 0
    assert triage.kept_per_head(float(ret[0, 2]), 1000, 25, quota="spread") > 0


# --- the swap's first decision: the prompt's last row ------------------------------------------------------
def test_swap_starts_from_the_anchor_attention_of_the_prompts_last_row():
    """The first selection equals the top-k chunks of the anchors' last-row attention that transformers' own
    forward pass reports (eager attention, output_attentions), and it is in force at decode step 0."""
    backbone = tiny_voxtral()
    backbone.eos_token_ids = [-1]
    prompt = backbone.build_prompt(noise_audio(20.0))
    vs = np.random.RandomState(3).rand(backbone.n_layers, backbone.n_kv_heads)
    scores = scores_for(vs, np.ones_like(vs), n_q_heads=backbone.n_q_heads)
    runs = {}
    for start in ("prefill", "decode"):
        wnw = WnW(scores=scores, n_voice=6, n_anchor=2, lam=0.3, swap_start=start, backbone_info=backbone.describe())
        res = generate(backbone, prompt, wnw, retention=0.2, max_new_tokens=4, keep_logits=True)
        runs[start] = (wnw, res)
    wnw, res = runs["prefill"]
    backbone.model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = backbone.model(input_ids=prompt.input_ids, output_attentions=True, **prompt.audio_inputs)
    finally:
        backbone.model.set_attn_implementation("sdpa")
    s, e = prompt.audio_span
    a = sum(out.attentions[li][0, wnw.anchor_q[li], -1, s:e].sum(0) for li in range(backbone.n_layers))
    ref = triage.ChunkSwap(prompt.n_audio, wnw.n_s, wnw.n_c, wnw.top_k, wnw.delta).select(a)
    trace = res.trace["wnw"]
    assert trace["selected_chunks"][0] == ref
    assert len(trace["selected_chunks"]) == len(res.tokens)  # the prefill decision, then one per decode step
    wnw_d, res_d = runs["decode"]
    assert len(res_d.trace["wnw"]["selected_chunks"]) == len(res_d.tokens) - 1
    # the first token comes from prefill in both; decode step 0 (the second token's logits) already attends to
    # the recalled segments only when the swap starts from the prompt's last row
    assert torch.equal(res.logits[0], res_d.logits[0])
    assert not torch.equal(res.logits[1], res_d.logits[1])


# --- the chunk swap on the device = the host one ------------------------------------------------------------
def _swap_inputs(n_audio: int, steps: int, seed: int):
    """Anchor attention for `steps` decisions, in turn: peaked, flat (every chunk ties), plateaus of equal means,
    a softmax."""
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        kind = step % 4
        if kind == 0:
            yield torch.rand(n_audio, generator=g) ** 8
        elif kind == 1:
            yield torch.zeros(n_audio)
        elif kind == 2:
            a = torch.zeros(n_audio)
            a[torch.randint(0, n_audio, (3,), generator=g)] = 1.0
            yield a
        else:
            yield torch.softmax(torch.randn(n_audio, generator=g) * 3, 0).float()


@pytest.mark.parametrize("n_audio,n_s,n_c,top_k,delta", [(1000, 25, 50, 3, 3), (110, 25, 50, 3, 3), (60, 25, 50, 3, 3),
                                                         (1037, 25, 30, 2, 1), (400, 10, 20, 1, 4)])
def test_device_chunk_swap_decides_as_the_host_one_step_by_step(n_audio, n_s, n_c, top_k, delta):
    """`DeviceChunkSwap` (tensors, in place: what runs in the CUDA graph) gives `ChunkSwap`'s chunks, recalls and
    releases at every step, ties included (flat attention, plateaus, exact zeros)."""
    host = triage.ChunkSwap(n_audio, n_s, n_c, top_k, delta)
    dev = triage.DeviceChunkSwap(n_audio, n_s, n_c, top_k, delta, torch.device("cpu"))
    for a in _swap_inputs(n_audio, 40, seed=n_audio + top_k):
        selected, recall, release = host.step(a.clone())
        d_sel, d_rec, d_rel = dev.step(a.clone())
        assert d_sel.nonzero().flatten().tolist() == selected
        assert d_rec.nonzero().flatten().tolist() == recall
        assert d_rel.nonzero().flatten().tolist() == release
        assert dev.recalled.numpy().tolist() == host.recalled.tolist()


@pytest.mark.parametrize("n_audio,n_s,n_c,top_k,delta", [(1000, 25, 50, 3, 3), (110, 25, 50, 3, 3), (60, 25, 50, 3, 3),
                                                         (1037, 25, 30, 2, 1), (400, 10, 20, 1, 4), (20, 25, 50, 3, 3)])
def test_fused_chunk_swap_decides_as_the_host_one_step_by_step(n_audio, n_s, n_c, top_k, delta):
    """The one-launch Triton decision (`FusedChunkSwap`, Triton's interpreter on the CPU) gives `ChunkSwap`'s
    chunks, recalls and releases at every step, ties included, records them at its counter, counts the recalled
    segments, and zeroes the scores for the next step."""
    needs_triton_interpreter()
    from wnw_exp.methods.wnw.triton_swap import FusedChunkSwap

    host = triage.ChunkSwap(n_audio, n_s, n_c, top_k, delta)
    dev = triage.DeviceChunkSwap(n_audio, n_s, n_c, top_k, delta, torch.device("cpu"))
    steps = 40
    records = dict(selected=torch.zeros(steps + 2, dev.n_chunks, dtype=torch.bool),
                   recall=torch.zeros(steps + 2, dev.n_seg, dtype=torch.bool),
                   release=torch.zeros(steps + 2, dev.n_seg, dtype=torch.bool),
                   resident=torch.zeros(steps + 2, dtype=torch.long))
    t = torch.zeros((), dtype=torch.long)
    fused = FusedChunkSwap(dev, records, t, n_s, n_c, top_k, delta)
    for step, a in enumerate(_swap_inputs(n_audio, steps, seed=n_audio + top_k)):
        selected, recall, release = host.step(a.clone())
        scores = a.clone()
        f_sel, f_rec, f_rel = fused(scores)
        assert f_sel.nonzero().flatten().tolist() == selected
        assert f_rec.nonzero().flatten().tolist() == recall
        assert f_rel.nonzero().flatten().tolist() == release
        assert dev.recalled.numpy().tolist() == host.recalled.tolist()
        assert int(t) == step + 1 and not scores.any()
        assert records["selected"][step].nonzero().flatten().tolist() == selected
        assert records["recall"][step].nonzero().flatten().tolist() == recall
        assert records["release"][step].nonzero().flatten().tolist() == release
        assert int(records["resident"][step]) == int(host.recalled.sum())
    assert not records["selected"][steps:].any()


def _pair(lag=1, n_audio=100, kernels="auto"):
    """make_policy's WnW on the reference store (host swap) and on the packed store (device swap, with `kernels`)."""
    import functools

    from wnw_exp.kv.packed import PackedAudioKVStore

    out = []
    for cls in (AudioKVStore, functools.partial(PackedAudioKVStore, kernels=kernels)):
        policy, store = make_policy(n_audio, delta=2, store_cls=cls, lag=lag, dense_capacity=32)
        store.compact(headroom=policy.recall_headroom)
        out.append((policy, store))
    return out


def _drive(lag, steps=16, kernels="auto"):
    """Both stores through `steps` decode steps of anchor attention on one random chunk; per step the tidal head's
    device positions on each store."""
    (host, ref), (dev, packed) = _pair(lag, kernels=kernels)
    assert not host.on_device and dev.on_device
    g = torch.Generator().manual_seed(3)
    held = []
    for s in range(steps):
        p = torch.full((2, 100), 1e-4)
        start = int(torch.randint(0, 80, (1,), generator=g))
        p[:, start:start + 20] = 0.05
        for policy in (host, dev):
            policy.observe(0, p.clone())
            policy.after_step(s)
        assert ref.end_step() == packed.end_step()
        held.append((gpu_positions(ref, 1, 1), _packed_positions(packed, 1, 1)))
    return host, ref, dev, packed, held


@pytest.mark.parametrize("lag", [1, 2])
def test_wnw_on_the_packed_store_decides_on_the_device_as_on_the_host(lag):
    """Step by step, the device swap (packed store) and the host swap (reference store) record the same decisions,
    hold the same positions on the device and account the same bytes."""
    host, ref, dev, packed, held = _drive(lag)
    assert all(a == b for a, b in held)
    assert dev.trace() == host.trace() and len(host.trace()["wnw"]["selected_chunks"]) == 16
    accounting = lambda st: {k: v for k, v in st.summary().items() if k != "audio_bytes_on_device"}  # noqa: E731
    assert accounting(ref) == accounting(packed) and ref.summary()["mb_per_step"] > 0  # (packed: + recall room)
    assert dev.knobs() == host.knobs() and (host.knobs().get("lag") == 2) == (lag == 2)


def test_pipelined_swap_moves_one_step_later():
    """lag 2: the same decisions as lag 1 (they follow the attention, not what is resident), each in force one step
    later: what lag 1 holds after step s, lag 2 holds after step s + 1."""
    one, two = _drive(1), _drive(2)
    assert one[0].trace()["wnw"] == two[0].trace()["wnw"]
    assert [h for h, _ in two[4][1:]] == [h for h, _ in one[4][:-1]]
    assert two[4][0][0] == gpu_positions(_pair(2)[0][1], 1, 1)  # nothing moved after the first step


def _packed_positions(store, layer, head):
    return (store.slot_of[layer * store.n_kv_heads + head] >= 0).nonzero().flatten().tolist()


def _triton_stream_sets(lengths, n_sets):
    """`n_sets` identical sets of WnW streams (policy, packed store with Triton kernels), one per audio length."""
    import functools

    from wnw_exp.kv.packed import PackedAudioKVStore

    sets = []
    for _ in range(n_sets):
        streams = []
        for n in lengths:
            policy, store = make_policy(n, delta=2, store_cls=functools.partial(PackedAudioKVStore, kernels="triton"),
                                        dense_capacity=32)
            store.compact(headroom=policy.recall_headroom)
            assert policy.on_device
            streams.append((policy, store))
        sets.append(streams)
    return sets


@pytest.mark.parametrize("fails", [False, True])
def test_wnw_with_triton_kernels_decides_as_the_host_and_falls_back_if_the_kernel_fails(fails, monkeypatch):
    """On a packed store with Triton kernels (Triton's interpreter here) WnW decides in one launch
    (`FusedChunkSwap`); the decisions and the positions held are the host swap's, step by step. A chunk-swap
    kernel that raises (one this GPU cannot compile) warns once and the PyTorch decision takes over, with the
    same results."""
    needs_triton_interpreter()
    import warnings as w

    from wnw_exp.methods.wnw import triton_swap

    launches = []
    decide = triton_swap.FusedChunkSwap.__call__

    def counted(self, scores):
        launches.append(1)
        if fails:
            raise RuntimeError("no kernel for this GPU")
        return decide(self, scores)

    monkeypatch.setattr(triton_swap.FusedChunkSwap, "__call__", counted)
    with w.catch_warnings(record=True) as caught:
        w.simplefilter("always")
        host, ref, dev, packed, held = _drive(1, steps=12, kernels="triton")
    assert all(a == b for a, b in held)
    assert dev.trace() == host.trace()
    fell_back = [x for x in caught if "one-launch chunk swap failed" in str(x.message)]
    # every decision in one launch; or one failed try, then the PyTorch decision for good (no second try, no warning)
    assert (len(launches), len(fell_back)) == ((1, 1) if fails else (12, 0))


def test_batched_chunk_swap_decides_and_queues_as_each_stream_alone(monkeypatch):
    """Three WnW streams of different audio lengths (packed stores with Triton kernels, Triton's interpreter on the
    CPU), four ways each step: each policy's `after_step` as inside a graph capture (its one-launch decision and its
    store's one-launch queueing, what a captured step runs); `WnW.after_step_all` as inside a capture (the batch's
    decisions in one launch, `ChunkSwapTables`, and its stores' queueing in another, `SegmentQueueTables`: what a
    captured batched step runs);
    `WnW.after_step_all` eagerly (the batch's warm-up steps); each policy's own `after_step`. The same decisions
    (the recorded trace), segment states, zeroed scores and queues in all four, step by step, the stores flushed
    between steps. (The capture is simulated: the CPU has none.)"""
    needs_triton_interpreter()
    import wnw_exp.kv.packed as packed

    lengths = (100, 70, 130)
    sets = _triton_stream_sets(lengths, 4)
    alone, tables, together, own = sets
    held: dict = {}
    captured_held: dict = {}
    made = []
    g = torch.Generator().manual_seed(5)
    for step in range(10):
        for b, n in enumerate(lengths):
            p = torch.full((2, n), 1e-4)
            start = int(torch.randint(0, n - 20, (1,), generator=g))
            p[:, start:start + 20] = 0.05 + 0.01 * b
            for streams in sets:
                streams[b][0].observe(0, p.clone())
        with monkeypatch.context() as capture:
            capture.setattr(packed, "_capturing", lambda: True)
            for policy, _ in alone:
                policy.after_step(None)  # a captured step has no step number
            WnW.after_step_all([p for p, _ in tables], [None] * len(lengths), captured_held)
        WnW.after_step_all([p for p, _ in together], [step] * len(lengths), held)
        made.append((held["swap_tables"], held["queue_tables"]["queue"]))
        for policy, _ in own:
            policy.after_step(step)
        for b in range(len(lengths)):
            (pa, sa), *rest = [streams[b] for streams in sets]
            assert sa.queued_recall.any() or sa.queued_release.any() or step > 0
            trace = pa.trace()["wnw"]
            assert len(trace["selected_chunks"]) == step + 1
            for pb, sb in rest:
                assert torch.equal(sa.queued_recall, sb.queued_recall) and torch.equal(sa.queued_release, sb.queued_release)
                assert pb.trace()["wnw"] == trace, (step, b)
                assert not pb.scores_acc.any()
                for name in ("recalled", "unselected"):
                    assert torch.equal(getattr(pa.device_swap, name), getattr(pb.device_swap, name))
        for streams in sets:
            for _, store in streams:
                store.end_step()
        for b in range(len(lengths)):
            sa = alone[b][1]
            for streams in sets[1:]:
                assert torch.equal(sa.slot_of, streams[b][1].slot_of)
    assert all(m[0] is made[0][0] and m[1] is made[0][1] for m in made)  # the batch's tables are made once
    assert "swap_tables" in captured_held  # the captured batch decided in one launch too
    for policy, _ in alone:
        trace = policy.trace()["wnw"]
        assert any(trace["recalled_segments"]) and any(trace["released_segments"])


def test_batched_chunk_swap_falls_back_to_each_streams_pytorch_decision_if_the_kernel_fails(monkeypatch):
    """`WnW.after_step_all` with a batched decision kernel that raises (one this GPU cannot compile) warns and each
    policy decides with the PyTorch kernels, as on its own after such a failure: the same records and queues as
    policies stepping on their own with the PyTorch decision."""
    needs_triton_interpreter()
    import warnings as w

    from wnw_exp.methods.wnw import triton_swap

    def broken(self):
        raise RuntimeError("no kernel for this GPU")

    import functools

    from wnw_exp.kv.packed import PackedAudioKVStore

    monkeypatch.setattr(triton_swap.ChunkSwapTables, "decide", broken)
    lengths = (100, 70)
    batch = _triton_stream_sets(lengths, 1)[0]
    # the same streams on stores with PyTorch kernels: the PyTorch decision
    own = [make_policy(n, delta=2, store_cls=functools.partial(PackedAudioKVStore, kernels="torch"), dense_capacity=32)
           for n in lengths]
    for policy, store in own:
        store.compact(headroom=policy.recall_headroom)
    sets = [batch, own]
    held: dict = {}
    with w.catch_warnings(record=True) as caught:
        w.simplefilter("always")
        for step in range(6):
            for b, n in enumerate(lengths):
                for streams in sets:
                    streams[b][0].observe(0, focus(n, (13 * step + 7 * b) % (n - 20)))
            WnW.after_step_all([p for p, _ in batch], [step] * 2, held)
            for policy, _ in own:
                policy.after_step(step)
            for (pa, sa), (pb, sb) in zip(batch, own):
                assert torch.equal(sa.queued_recall, sb.queued_recall) and torch.equal(sa.queued_release, sb.queued_release)
                assert pa.trace()["wnw"] == pb.trace()["wnw"] and len(pa.trace()["wnw"]["selected_chunks"]) == step + 1
            for streams in sets:
                for _, store in streams:
                    store.end_step()
    # one warning in six steps: after the failure the batch's policies decide on their own for good
    assert len([x for x in caught if "one-launch chunk swap failed" in str(x.message)]) == 1
    assert "swap_tables" not in held
    assert any(batch[0][0].trace()["wnw"]["recalled_segments"])


def test_a_subclass_signal_is_applied_once_per_decision_alone_and_in_a_batch():
    """`WnW._adjust_signal` (how the benchmarks script the anchor attention) runs once before every decision, both
    when each policy decides on its own (`after_step`) and when a batch's policies decide in one launch
    (`after_step_all`, Triton's interpreter): the same counters, decisions and queues either way. (The batched
    decision once skipped a subclass's `after_step`, so the benchmarks' streams decided on unscripted attention.)"""
    needs_triton_interpreter()

    class Scripted(WnW):
        def _adjust_signal(self, step):
            if step != -1:
                start = int(self.focus_step) * 7 % (self.ctx.n_audio - 20)
                self.scores_acc[start:start + 20] += 1.0
                self.focus_step += 1

    lengths = (100, 130)
    sets = _triton_stream_sets(lengths, 2)
    for policy, _ in sets[0] + sets[1]:
        policy.__class__ = Scripted
        policy.focus_step = torch.zeros((), dtype=torch.long)
    batch, own = sets
    held: dict = {}
    for step in range(8):
        Scripted.after_step_all([p for p, _ in batch], [step] * len(lengths), held)
        for p, _ in own:
            p.after_step(step)
        for (pa, sa), (pb, sb) in zip(batch, own):
            assert int(pa.focus_step) == int(pb.focus_step) == step + 1
            assert torch.equal(sa.queued_recall, sb.queued_recall) and torch.equal(sa.queued_release, sb.queued_release)
            assert pa.trace()["wnw"] == pb.trace()["wnw"], step
        for streams in sets:
            for _, store in streams:
                store.end_step()
    assert "swap_tables" in held  # the batch decided in one launch
    # the scripted focus moved, so segments were recalled
    assert all(any(p.trace()["wnw"]["recalled_segments"]) for p, _ in batch)
