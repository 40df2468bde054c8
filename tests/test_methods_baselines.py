"""The baselines adakv, arkvale, affpool: their scoring pieces on hand-computed examples, and through the
engine on tiny random models (exact Full tokens at retention 1.0, measured r_GPU on target, bytes freed,
ArkVale's recall)."""

import json
import math

import pytest
import torch
import yaml

from helpers import noise_audio, tiny_qwen_omni, tiny_voxtral
from wnw_exp.engine.decode import place
from wnw_exp.engine.serve import generate
from wnw_exp.methods import build_policy
from wnw_exp.methods.base import SampleContext
from wnw_exp.methods.affpool import integer_keep_ratio, layer_counts, merge_threshold, run_groups
from wnw_exp.methods.arkvale import key_digests, page_scores
from wnw_exp.methods.scoring import (adakv_capacities, balanced_bounds, group_mean, keep_top, pool1d, top_masks,
                                     snapkv_scores, spread_budget, window_mean)
from wnw_exp.paths import conf_dir

CONF = conf_dir() / "method"
METHODS = ["adakv", "arkvale", "affpool"]
N_NEW = 12


def method_cfg(name: str) -> dict:
    return yaml.safe_load((CONF / f"{name}.yaml").read_text())


# --- scoring pieces -----------------------------------------------------------------------------------
def test_max_pooling_kernel_7_keeps_length_and_ignores_padding():
    s = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.9, 0.0, 0.0],
                      [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0, -9.0, -10.0, -11.0, -12.0]])
    out = pool1d(s, 7, "max")
    assert out.shape == s.shape
    # A peak spreads 3 positions either side.
    assert out[0].tolist() == pytest.approx([0.0] * 6 + [0.9] * 6)
    # Negative scores: the -inf padding never wins, a border sees only its real neighbours.
    assert out[1].tolist() == pytest.approx([-1, -1, -1, -1, -2, -3, -4, -5, -6, -7, -8, -9])


def test_avg_pooling_counts_the_zero_padding_like_torch_and_kvpress():
    s = torch.ones(1, 5)
    assert pool1d(s, 7, "avg")[0].tolist() == pytest.approx([4 / 7, 5 / 7, 5 / 7, 5 / 7, 4 / 7])


def test_snapkv_scores_use_the_last_window_rows_then_group_mean_then_pool():
    torch.manual_seed(0)
    post = torch.softmax(torch.randn(4, 5, 20), dim=-1)  # H_q=4, 5 rows after the audio, 20 audio positions
    got = snapkv_scores(post, window=3, kernel=7, pooling="max", group=2)
    rows = post[:, -3:].mean(dim=1)
    kv = torch.stack([(rows[0] + rows[1]) / 2, (rows[2] + rows[3]) / 2])
    want = torch.stack([torch.tensor([kv[h, max(0, i - 3):i + 4].max() for i in range(20)]) for h in range(2)])
    assert torch.allclose(got, want)
    # A window longer than the rows takes all the rows.
    assert torch.allclose(window_mean(post, 32), post.mean(dim=1))
    assert torch.allclose(group_mean(rows, 2), kv)


def test_adakv_allocation_matches_a_hand_computed_example():
    # 2 KV heads, 10 positions, per-head budget B = 4 (layer total 8), floor_alpha 0.5.
    scores = torch.tensor([
        [0.90, 0.80, 0.70, 0.60, 0.50, 0.40, 0.05, 0.04, 0.03, 0.02],
        [0.10, 0.09, 0.08, 0.07, 0.06, 0.35, 0.01, 0.30, 0.00, 0.20],
    ])
    # Layer top-8: head 0 holds 0.90 .. 0.40 (6), head 1 holds 0.35, 0.30 (2).
    # caps = round(c * (1 - 0.5) + int(4 * 0.5)) = round(3 + 2), round(1 + 2) = 5, 3.
    caps = adakv_capacities(scores, 4, 0.5)
    assert caps.tolist() == [5, 3]
    kept = keep_top(scores, caps)
    assert kept[0].tolist() == [0, 1, 2, 3, 4]
    assert kept[1].tolist() == [5, 7, 9]
    # floor_alpha 0.8: floor int(3.2) = 3; caps = round(6 * 0.2 + 3), round(2 * 0.2 + 3) = round(4.2), round(3.4).
    assert adakv_capacities(scores, 4, 0.8).tolist() == [4, 3]
    # floor_alpha 1: uniform per-head top-B.
    assert adakv_capacities(scores, 4, 1.0).tolist() == [4, 4]


def test_top_masks_keep_each_heads_top_positions_ties_to_the_earlier():
    """The masks of a layer's heads from one sort against a plain Python ranking of each head (score descending,
    position ascending), on scores with many ties and caps from 0 to n."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 4, (6, 23), generator=g).float()  # few distinct values: ties everywhere
    caps = torch.tensor([0, 1, 5, 11, 22, 23])
    masks = top_masks(scores, caps)
    for h in range(6):
        want = sorted(sorted(range(23), key=lambda i: (-float(scores[h, i]), i))[: int(caps[h])])
        assert masks[h].nonzero().flatten().tolist() == want == keep_top(scores, caps)[h].tolist()


def test_budget_spreading_and_balanced_pages():
    assert spread_budget(7, 4) == [1, 2, 2, 2]
    assert sum(spread_budget(116, 12)) == 116 and set(spread_budget(116, 12)) == {9, 10}
    b = balanced_bounds(750, 32)  # 24 pages of 31 or 32 tokens
    sizes = (b[1:] - b[:-1]).tolist()
    assert len(sizes) == 24 and sum(sizes) == 750 and set(sizes) == {31, 32}
    assert balanced_bounds(64, 32).tolist() == [0, 32, 64]
    assert balanced_bounds(5, 32).tolist() == [0, 5]


def test_arkvale_digests_and_page_scores_follow_the_arkvale_code():
    keys = torch.tensor([[1.0, -2.0], [3.0, 0.0], [2.0, 4.0],  # page 0
                         [0.0, 1.0], [0.0, 3.0]])  # page 1
    hi, lo = key_digests(keys, torch.tensor([0, 3, 5]))
    # page 0: center (max + min) / 2 = (2, 1), mean |center - k| = (2/3, 7/3)
    assert hi[0].tolist() == pytest.approx([2 + 2 / 3, 1 + 7 / 3])
    assert lo[0].tolist() == pytest.approx([2 - 2 / 3, 1 - 7 / 3])
    # page 1: center (0, 2), dist (0, 1)
    assert hi[1].tolist() == pytest.approx([0, 3]) and lo[1].tolist() == pytest.approx([0, 1])
    q = torch.tensor([[1.0, -1.0], [0.0, 2.0]])  # a group of two query heads
    s = page_scores(q[None], hi[None], lo[None])[0]
    # sum_d max(q_d * hi_d, q_d * lo_d), then the mean over the two query heads
    want0 = ((2 + 2 / 3) + -(1 - 7 / 3) + 2 * (1 + 7 / 3)) / 2  # = 16/3
    want1 = (0 + -1 + 2 * 3) / 2
    assert s.tolist() == pytest.approx([want0, want1])


def test_affinity_runs_are_cut_at_the_window_and_the_threshold_hits_the_count():
    links = torch.tensor([True, True, True, True, False, True])  # chains: 0-4, 5-6
    assert run_groups(links, 3).tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert run_groups(links, 1).tolist() == list(range(7))
    aff = torch.tensor([0.9, 0.1, 0.8, 0.7, 0.2, 0.95, 0.3])  # 8 tokens
    for target in range(3, 8):
        tau, group = merge_threshold(aff, target, 3)
        assert int(group[-1]) + 1 == target
        links = aff >= tau
        assert torch.equal(group, run_groups(links, 3))
    tau, _ = merge_threshold(aff, 6, 3)
    assert tau == pytest.approx(0.9)  # the two best pairs (0.95, 0.9) merge


def test_affpool_merges_runs_by_size_weighted_mean_at_the_centre_position():
    pol = build_policy(method_cfg("affpool"))
    pol.start(SampleContext(n_layers=3, n_q_heads=2, n_kv_heads=1, head_dim=4, token_rate=12.5, n_audio=6,
                            retention=0.5, device=torch.device("cpu")), store=None)
    assert pol.n_pool == 3  # round(3 * 3 / 30) = 0 tail layers on a 3-layer model
    pol.rho, pol.counts = 0.5, [3, 2, 2]  # layer 0 keeps 3 tokens, layer 1 2
    a, a2, b, c = [1.0, 0, 0, 0], [1.0, 0.1, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0]
    text = [5.0, 5, 5, 5]
    hidden = torch.tensor([[text, a, a, a2, b, b, c, text]])
    positions = torch.arange(8)[None]
    h1, p1, span1 = pol.prefill_transform(0, hidden, positions, (1, 7))
    assert span1 == (1, 4)
    want = torch.tensor([text, [(1 + 1 + 1) / 3, 0.1 / 3, 0, 0], b, c, text])
    assert torch.allclose(h1[0], want)
    assert p1[0].tolist() == [0, 2, 4, 6, 7]  # centres (1+2+3)/3 = 2, (4+5)/2 = 4.5 -> 4 (half to even), 6
    # Deep pooling before layer 1: the pair B (2 originals) ~ C (1 original) merges, weighted 2:1.
    deep = torch.tensor([[text, a, [0, 1.0, 0.2, 0], [0, 1.0, 0.3, 0], text]])
    h2, p2, span2 = pol.prefill_transform(1, deep, p1, span1)
    assert span2 == (1, 3)
    assert torch.allclose(h2[0, 2], torch.tensor([0, 1.0, (2 * 0.2 + 0.3) / 3, 0]))
    assert p2[0].tolist() == [0, 2, 5, 7]  # (4.5 * 2 + 6) / 3 = 5: centres come from the original positions
    assert pol.knobs()["tau"][0] == pytest.approx(float(torch.nn.functional.cosine_similarity(
        torch.tensor(a), torch.tensor(a2), dim=0)), abs=1e-4)


def test_affpool_keep_ratio_keeps_the_integer_counts_at_or_under_the_target():
    assert layer_counts(375, 1 / 3, 3, 3, 3) == [125, 42, 14]  # ceil(375 / 3), ceil(125 / 3), ceil(42 / 3)
    assert layer_counts(1000, 0.5, 4, 2, 3) == [500, 250, 250, 250]  # the tail keeps what the last pooling left
    rho = integer_keep_ratio(0.2, 1000, 30, 27, 3)
    assert sum(layer_counts(1000, rho, 30, 27, 3)) <= 0.2 * 30 * 1000  # the promise: never above
    assert sum(layer_counts(1000, rho + 1e-6, 30, 27, 3)) > 0.2 * 30 * 1000  # and the largest such rho
    assert integer_keep_ratio(1.0, 1000, 30, 27, 3) == 1.0
    assert integer_keep_ratio(0.001, 375, 3, 3, 3) == pytest.approx(1 / 3)  # below the reachable floor


# --- through the engine ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def voxtral():
    backbone = tiny_voxtral()
    backbone.eos_token_ids = [-1]  # always N_NEW tokens: every method decodes the same number of steps
    return backbone


@pytest.fixture(scope="module")
def long_prompt(voxtral):
    prompt = voxtral.build_prompt(noise_audio(30.0, seed=3))
    assert prompt.n_audio == 375  # 12 ArkVale pages of 31-32 tokens
    return prompt


@pytest.fixture(scope="module")
def runs(voxtral, long_prompt):
    """(method, retention) -> DecodeResult on the 30 s clip, computed once."""
    cache = {}

    def get(name: str, retention: float):
        if (name, retention) not in cache:
            policy = build_policy(method_cfg(name) if name != "full" else {"name": "full"}, voxtral.describe())
            cache[name, retention] = generate(voxtral, long_prompt, policy, retention=retention,
                                              max_new_tokens=N_NEW)
        return cache[name, retention]

    return get


@pytest.mark.parametrize("name", METHODS)
def test_retention_one_gives_exactly_full_tokens(name, runs):
    full, res = runs("full", 1.0), runs(name, 1.0)
    assert len(set(full.tokens)) > 3, "the test model must not just repeat one token"
    assert res.tokens == full.tokens
    assert res.store_summary["r_gpu"] == 1.0 and res.store_summary["mb_per_step"] == 0.0


@pytest.mark.parametrize("retention", [0.2, 0.6])
@pytest.mark.parametrize("name", METHODS)
def test_measured_r_gpu_is_within_two_points_of_the_target(name, retention, runs):
    s = runs(name, retention).store_summary
    assert abs(s["r_gpu"] - retention) <= 0.02, s
    assert abs(s["r_gpu_end"] - retention) <= 0.02, s
    if name == "arkvale":
        assert s["r_gpu_cpu"] == 1.0  # a full CPU mirror of the evicted pages
    else:
        assert s["r_gpu_cpu"] == s["r_gpu"]  # nothing recallable: the rest is dropped or merged away


@pytest.mark.parametrize("name", METHODS)
def test_audio_bytes_on_device_at_retention_02_are_at_most_a_quarter_of_full(name, runs):
    full = runs("full", 1.0).store_summary["audio_bytes_on_device"]
    ours = runs(name, 0.2).store_summary["audio_bytes_on_device"]
    assert ours <= 0.25 * full, (ours, full)


def test_arkvale_recalls_pages_as_the_query_moves(runs):
    res = runs("arkvale", 0.2)
    assert res.store_summary["mb_per_step"] > 0
    assert sum(res.trace["h2d_bytes"][1:]) > 0  # recalls after the first step, not only the initial mirror
    # The resident count stays at the budget every step (pages differ by at most one token in size).
    budget_pages = 0.2 * 12 * 3 * 4
    assert max(res.trace["gpu_audio_tokens"]) - min(res.trace["gpu_audio_tokens"]) <= math.ceil(budget_pages)


@pytest.mark.parametrize("name", METHODS)
def test_gqa_and_mrope_backbone_runs_on_target(name):
    """Qwen2.5-Omni thinker: GQA group 4, M-RoPE (3, 1, T) positions for AffPool's merged tokens."""
    backbone = tiny_qwen_omni()
    backbone.eos_token_ids = [-1]
    prompt = backbone.build_prompt(noise_audio(30.0, seed=2))
    policy = build_policy(method_cfg(name), backbone.describe())
    res = generate(backbone, prompt, policy, retention=0.4, max_new_tokens=4)
    assert abs(res.store_summary["r_gpu"] - 0.4) <= 0.02, res.store_summary
    assert len(res.tokens) == 4
    json.dumps(policy.knobs(), allow_nan=False)  # recorded in predictions.jsonl


# --- ArkVale's step 5 on the device = the per-head host rule ----------------------------------------------
def _arkvale_pair(n_audio=200, layers=2, heads=2, group=2, d=8, retention=0.4, seed=0, device="cpu",
                  stores=("reference", "packed"), tied_pages=False):
    """The same ArkVale placement on two stores: by default the reference store (host rule) and the packed store
    (device rule); "torch"/"triton": the packed store with those kernels. `tied_pages`: the audio keys repeat the
    first key of each run of 57 positions, so that the pages inside a run have equal digests (and any query gives
    them equal scores)."""
    import functools

    from wnw_exp.kv.packed import PackedAudioKVStore
    from wnw_exp.kv.reference import AudioKVStore
    from wnw_exp.methods.base import PrefillScores

    device = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    ctx = SampleContext(n_layers=layers, n_q_heads=heads * group, n_kv_heads=heads, head_dim=d, token_rate=12.5,
                        n_audio=n_audio, retention=retention, device=device)
    k = torch.randn(layers, heads, n_audio + 3, d, generator=g)
    if tied_pages:
        k[:, :, 1:1 + n_audio] = k[:, :, 1 + torch.arange(n_audio) // 57 * 57]
    k = k.to(device)
    post = torch.rand(layers, heads * group, 2, n_audio, generator=g).to(device)
    kinds = dict(reference=AudioKVStore, packed=PackedAudioKVStore,
                 torch=functools.partial(PackedAudioKVStore, kernels="torch"),
                 triton=functools.partial(PackedAudioKVStore, kernels="triton"))
    pair = []
    for cls in (kinds[name] for name in stores):
        store = cls(layers, heads, d, n_audio, device, torch.float32, dense_capacity=16)
        policy = build_policy(method_cfg("arkvale"), {})
        policy.start(ctx, store)
        for li in range(layers):
            store.write_prefill(li, k[li], k[li] + 1, (1, 1 + n_audio))
            place(policy, store, li, PrefillScores(post[li], audio_keys=k[li, :, 1:1 + n_audio]))
        store.compact(headroom=policy.recall_headroom)
        pair.append((policy, store))
    return pair


def _resident(store, layer, head):
    if hasattr(store, "heads"):
        return sorted(store.heads[layer][head].gpu_pos.tolist())
    return (store.slot_of[layer * store.n_kv_heads + head] >= 0).nonzero().flatten().tolist()


def test_arkvale_swaps_the_same_pages_on_the_device_as_on_the_host():
    """Step 5 for every head at once on tensors (`swap_pages`, what the packed store's runs use) chooses the pages
    of the per-head host rule (`swap_head`, torch.topk), step by step, and the stores then hold the same positions."""
    (host, ref), (dev, packed) = _arkvale_pair()
    assert not host.on_device and dev.on_device
    g = torch.Generator().manual_seed(5)
    n_pages = len(host.bounds) - 1
    moved = 0
    for step in range(8):
        for li in range(2):
            scores = torch.randn(2, n_pages, generator=g)  # distinct values: both rules have one answer
            want = [host.swap_head(li, h, scores[h]) for h in range(2)]
            victims, missing = dev.swap_pages(li, scores.clone())
            for h, (v, m) in enumerate(want):
                assert victims[h].nonzero().flatten().tolist() == sorted(v.tolist())
                assert missing[h].nonzero().flatten().tolist() == sorted(m.tolist())
                moved += len(m)
            assert torch.equal(dev.resident[li], host.resident[li])
    assert moved > 0  # pages really moved
    # through the stores: the device rule's masks, queued and flushed, hold the host rule's positions
    (host, ref), (dev, packed) = _arkvale_pair(seed=1)
    for step in range(6):
        for li in range(2):
            q = torch.randn(4, 8, generator=g)
            host.before_attention(li, q)
            dev.before_attention(li, q)
            for h in range(2):
                assert _resident(ref, li, h) == _resident(packed, li, h)
        assert ref.end_step() == packed.end_step()
    assert dev.knobs() == host.knobs() and host.knobs()["recalled_pages"] > 0


def test_arkvale_swap_kernel_is_swap_pages_and_its_queueing():
    """The one-kernel swap of the packed store's Triton path (methods/arkvale/kernels.py, in Triton's interpreter
    without CUDA) = `swap_pages` plus its store calls (the packed store's PyTorch path), step by step through
    `before_attention`: the same resident pages, the same positions on the device, the same recalled pages; on
    random keys, and on keys whose pages tie in pairs (ties broken alike)."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (optional `gpu` extra)")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA and triton was imported without TRITON_INTERPRET=1")

    # on a GPU the compiled kernel (CUDA tensors); without one, Triton's interpreter on CPU tensors
    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    g = torch.Generator().manual_seed(9)
    for ties in (False, True):
        (spec, spec_store), (kern, kern_store) = _arkvale_pair(seed=2, device=device, stores=("torch", "triton"),
                                                               tied_pages=ties)
        for step in range(6):
            for li in range(2):
                q = torch.randn(4, 8, generator=g)
                if ties:  # the premise: every head's pages score in tied pairs
                    hi, lo = spec.digests[li]
                    scores = page_scores(q.to(device).view(2, 2, -1), hi, lo)
                    assert all(len(set(row.tolist())) <= (len(row) + 1) // 2 for row in scores), scores
                spec.before_attention(li, q.to(device))
                kern.before_attention(li, q.to(device))
                assert torch.equal(kern.resident[li], spec.resident[li]), (ties, step, li)
                assert torch.equal(kern_store.slot_of, spec_store.slot_of), (ties, step, li)
        assert kern.knobs() == spec.knobs() and spec.knobs()["recalled_pages"] > 0
