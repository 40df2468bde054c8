"""Batched, continuous decoding (issue 16): `engine.serve.decode_batch` against the bs-1 engine (`generate`).

- the CPU default path (reference store and step): each sample of a batch gets bs 1's tokens, logits, accounting and
  method decisions byte for byte, on both backbone families, for Full, Ada-KV, ArkVale and WnW;
- the fused path over one KV pool (`BatchedFusedStep`, its kernels' PyTorch equivalents; GEMMs over the batch round
  differently, so logits within 1e-4, tokens equal);
- the pool is real: a pool with room for one stream decodes two one after the other with the same results, a stream
  that cannot fit an empty pool is refused, the memory comes back when streams leave;
- the batched Triton kernels (ragged attention over (stream, KV head) regions of a pool, RoPE + append, the whole
  batched step) against dense references: on CUDA, else in Triton's interpreter; skipped cleanly without triton.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import interpreted_prefill_in_torch, noise_audio, tiny_qwen_omni, tiny_voxtral
from wnw_exp.engine.serve import BatchStats, Request, decode_batch, generate
from wnw_exp.kv.pool import KVPool, PoolFull
from wnw_exp.methods import build_policy
from wnw_exp.paths import conf_dir

SHIPPED = Path(__file__).resolve().parents[1] / "src/wnw_exp/calibration/shipped/tiny_random.json"
HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON and not HAS_CUDA and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton


def _policy(method, backbone):
    cfg = {"name": method, **({"head_scores": str(SHIPPED)} if method == "wnw" else {})}
    return build_policy(cfg, dict(backbone.describe(), name="tiny_random"))


def _backbone(family):
    bb = (tiny_voxtral if family == "voxtral" else tiny_qwen_omni)()
    bb.eos_token_ids = [-1]  # every sample runs to its cap: the lengths below differ, so streams leave at different steps
    return bb


def _prompts(bb, seconds=(14.0, 8.0, 11.0)):
    return [bb.build_prompt(noise_audio(s, seed=i)) for i, s in enumerate(seconds)]


CAPS = (9, 5, 7)


def _solo_and_batched(bb, method, path, pool=None, caps=CAPS, seconds=(14.0, 8.0, 11.0), **kw):
    r = 0.2 if method != "full" else 1.0
    prompts = _prompts(bb, seconds)
    solo = [generate(bb, p, _policy(method, bb), retention=r, max_new_tokens=c, keep_logits=True, **path)
            for p, c in zip(prompts, caps)]
    template = _policy(method, bb)
    stats = BatchStats()
    batched = dict(decode_batch(bb, [Request(i, p, c) for i, (p, c) in enumerate(zip(prompts, caps))], template.fork,
                                retention=r, pool=pool, keep_logits=True, stats=stats, **path, **kw))
    return solo, batched, stats


@pytest.mark.parametrize("case", ["voxtral-full", "voxtral-adakv", "voxtral-arkvale", "voxtral-wnw", "qwen_omni-full",
                                  "qwen_omni-adakv", "qwen_omni-arkvale"])
def test_batched_reference_path_is_byte_identical_to_bs1(case):
    family, method = case.split("-")
    bb = _backbone(family)
    solo, batched, stats = _solo_and_batched(bb, method, dict(store="reference"), max_concurrent=3)
    assert stats.batch_sizes[0] == 1 and max(stats.batch_sizes) == 3  # joined one by one, then decoded together
    for i, a in enumerate(solo):
        b = batched[i]
        assert b.tokens == a.tokens and b.terminated == a.terminated
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
        assert b.store_summary == a.store_summary and b.trace == a.trace
        assert len(b.step_ms) == len(a.step_ms) == CAPS[i] - 1
    if method != "full":
        assert any(x.store_summary["r_gpu"] < 0.5 for x in solo)


@pytest.mark.parametrize("case", ["voxtral-wnw", "voxtral-arkvale", "voxtral-oracle", "qwen_omni-full"])
def test_batched_fused_step_on_a_pool_matches_bs1(case, monkeypatch):
    family, method = case.split("-")
    bb = _backbone(family)
    path = dict(store="packed", fused=True, kernels="torch")
    pool = KVPool(100_000, bb.head_dim, bb.dtype, bb.device)
    if method == "oracle":  # its ranking cuts the dense keys at the host's count: the device's, at every call
        from wnw_exp.kv.packed import PackedAudioKVStore

        dense_keys, calls = PackedAudioKVStore.dense_keys, []

        def checked(store, layer):
            calls.append(store._dense_n == int(store.dense_len))
            return dense_keys(store, layer)

        monkeypatch.setattr(PackedAudioKVStore, "dense_keys", checked)
    solo, batched, stats = _solo_and_batched(bb, method, path, pool=pool)
    if method == "oracle":
        assert len(calls) > 100 and all(calls)
    assert max(stats.batch_sizes) == 3
    for i, a in enumerate(solo):
        b = batched[i]
        assert b.tokens == a.tokens
        assert max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits)) < 1e-4
        assert b.store_summary == a.store_summary and b.trace == a.trace
    if method != "full":
        assert any(x.store_summary["mb_per_step"] > 0 for x in batched.values())  # the method really moved KV
    assert pool.used_blocks == 0 < pool.peak_blocks  # every stream gave its extent back
    # a result is made after its stream's memory went back to the pool (while the next step runs): what it
    # records is what the stream held, not the nothing it holds by then
    assert all(x.store_summary["audio_bytes_on_device"] > 0 for x in batched.values())
    # a new batched step is made exactly where the batch changes (a join or a leave), and its host time is a part
    # of that step's; every step (no graph on the CPU) runs the decisions and moves after its layers
    changed = [0] + [j for j in range(1, len(stats.batch_sizes)) if stats.batch_sizes[j] != stats.batch_sizes[j - 1]]
    assert [j for j, ms in enumerate(stats.step_build_ms) if ms > 0] == changed
    assert all(0 < a + b <= t for a, b, t in zip(stats.step_after_ms, stats.step_build_ms, stats.step_ms))


def test_a_pool_with_room_for_one_stream_runs_two_one_after_the_other():
    bb = _backbone("voxtral")
    path = dict(store="packed", fused=True, kernels="torch")
    big = KVPool(100_000, bb.head_dim, bb.dtype, bb.device)
    _, ref, _ = _solo_and_batched(bb, "wnw", path, pool=big, caps=(6, 6), seconds=(10.0, 10.0))
    one = big.peak_blocks // 2 + 1  # the two streams have the same size: room for one, not two
    small = KVPool(one * big.block, bb.head_dim, bb.dtype, bb.device)
    assert small.capacity_bytes == one * big.block * small.row_bytes  # a real allocation of that size
    solo, got, stats = _solo_and_batched(bb, "wnw", path, pool=small, caps=(6, 6), seconds=(10.0, 10.0))
    assert max(stats.batch_sizes) == 1 and small.n_refused >= 1  # the second waited for the first to leave
    for i in range(2):
        assert got[i].tokens == ref[i].tokens == solo[i].tokens
        assert got[i].store_summary == ref[i].store_summary
    assert small.used_blocks == 0


def test_a_stream_that_cannot_fit_an_empty_pool_is_refused_and_the_others_run():
    bb = _backbone("voxtral")
    path = dict(store="packed", fused=True, kernels="torch")
    prompts = [bb.build_prompt(noise_audio(s, seed=i)) for i, s in enumerate([90.0, 30.0])]
    solo = generate(bb, prompts[1], _policy("full", bb), retention=1.0, max_new_tokens=4, **path)
    probe = KVPool(100_000, bb.head_dim, bb.dtype, bb.device)
    list(decode_batch(bb, [Request(1, prompts[1], 4)], _policy("full", bb).fork, retention=1.0, pool=probe, **path))
    pool = KVPool(probe.peak_blocks * probe.block, bb.head_dim, bb.dtype, bb.device)  # fits the 30 s clip only
    stats = BatchStats()
    out = dict(decode_batch(bb, [Request(i, p, 4) for i, p in enumerate(prompts)], _policy("full", bb).fork,
                            retention=1.0, pool=pool, stats=stats, **path))
    assert isinstance(out[0], PoolFull) and "MB of KV" in str(out[0]) and stats.refused == [0]
    assert out[1].tokens == solo.tokens
    assert pool.used_blocks == 0


# --- the paged dense part: growth in pages, admission by expected growth, preemption ----------------------------
PAGED_SECONDS, PAGED_CAPS = (6.0, 4.0, 5.0), (12, 8, 10)
_PLACED: dict = {}


def _placed_blocks(bb, method, path, prompts):
    """Each request's blocks at admission (its audio extent and its prompt's dense pages), alone in a big pool."""
    r = 0.2 if method != "full" else 1.0
    out = []
    for i, p in enumerate(prompts):
        key = (method, p.input_ids.shape[1], sum(float(v.double().sum()) for v in p.audio_inputs.values()
                                                 if torch.is_tensor(v)))  # the same prompt
        if key not in _PLACED:
            probe = KVPool(200_000, bb.head_dim, bb.dtype, bb.device, block=4)
            list(decode_batch(bb, [Request(0, p, 1)], _policy(method, bb).fork, retention=r, pool=probe, **path))
            _PLACED[key] = probe.peak_blocks
        out.append(_PLACED[key])
    return out


def _counting_page_allocs(pool):
    calls = []
    alloc = pool.alloc_blocks
    pool.alloc_blocks = lambda n: calls.append(n) or alloc(n)
    return calls


@pytest.mark.parametrize("case", ["full-fused", "wnw-fused", "full-per_stream", "wnw-per_stream"])
def test_paged_pool_with_preemption_matches_bs1(case):
    """A pool of 4-row blocks with room for the three streams' placed KV and 2 dense pages more: admitted without
    reserve (reserve_tokens=0), the streams ask for pages mid-answer until the pool runs out, and the newest is
    preempted (restarted from scratch later), at least once; every result is still bs 1's. The fused path (GEMMs
    over the batch): tokens, accounting and traces equal, logits within 1e-4; the per-stream path over the pool
    (TorchStep on the pooled packed store): logits byte for byte those of `generate` on the packed store. The pool
    is empty at the end."""
    method, kind = case.split("-")
    bb = _backbone("voxtral")
    path = dict(store="packed", fused=kind == "fused", kernels="torch")
    r = 0.2 if method != "full" else 1.0
    prompts = _prompts(bb, PAGED_SECONDS)
    placed = _placed_blocks(bb, method, path, prompts)
    pool = KVPool((sum(placed) + 2 * bb.n_layers * bb.n_kv_heads) * 4, bb.head_dim, bb.dtype, bb.device, block=4)
    calls = _counting_page_allocs(pool)
    stats = BatchStats()
    reqs = [Request(i, p, c) for i, (p, c) in enumerate(zip(prompts, PAGED_CAPS))]
    got = dict(decode_batch(bb, reqs, _policy(method, bb).fork, retention=r, pool=pool, keep_logits=True,
                            stats=stats, reserve_tokens=0, **path))
    assert max(stats.batch_sizes) == 3 and len(stats.preempted) >= 1
    assert 2 in stats.preempted  # the newest goes first
    prompt_pages = 2  # 5 prompt text tokens in pages of 4 rows
    assert len(calls) > prompt_pages * (len(reqs) + len(stats.preempted))  # pages were given mid-answer
    assert pool.used_blocks == 0 and pool.peak_blocks <= pool.n_blocks
    for i, (p, c) in enumerate(zip(prompts, PAGED_CAPS)):
        a = generate(bb, p, _policy(method, bb), retention=r, max_new_tokens=c, keep_logits=True, **path)
        b = got[i]
        assert b.tokens == a.tokens and b.store_summary == a.store_summary and b.trace == a.trace
        if kind == "fused":
            assert max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits)) < 1e-4
        else:
            assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    if case == "full-fused":  # admission by expected growth: keeping room for every token, nobody is preempted
        pool2 = KVPool(pool.rows, bb.head_dim, bb.dtype, bb.device, block=4)
        stats2 = BatchStats()
        again = dict(decode_batch(bb, reqs, _policy(method, bb).fork, retention=r, pool=pool2, stats=stats2,
                                  reserve_tokens=1.0, **path))
        assert stats2.preempted == [] and max(stats2.batch_sizes) < 3
        assert all(again[i].tokens == got[i].tokens for i in got) and pool2.used_blocks == 0


def test_an_answer_the_pool_can_never_hold_fails_alone():
    """A pool with room for the long request's placed KV and a few pages of its answer, not all of them: it fails
    alone with one clear PoolFull (the other request, waiting or preempted, then runs and gets bs 1's tokens), and
    the pool is empty at the end."""
    bb = _backbone("voxtral")
    path = dict(store="packed", fused=True, kernels="torch")
    prompts = _prompts(bb, PAGED_SECONDS)[:2]
    placed = _placed_blocks(bb, "full", path, prompts)[:1]
    pool = KVPool((placed[0] + 3 * bb.n_layers * bb.n_kv_heads) * 4, bb.head_dim, bb.dtype, bb.device, block=4)
    stats = BatchStats()
    out = list(decode_batch(bb, [Request(0, prompts[0], 24), Request(1, prompts[1], 4)], _policy("full", bb).fork,
                            retention=1.0, pool=pool, stats=stats, **path))
    errors = [(k, e) for k, e in out if isinstance(e, Exception)]
    assert len(errors) == 1 and errors[0][0] == 0 and isinstance(errors[0][1], PoolFull)
    assert "cannot hold this stream's answer" in str(errors[0][1]) and "no other stream is left" in str(errors[0][1])
    assert stats.refused == []  # it was admitted: its placed KV fits, its answer does not
    solo = generate(bb, prompts[1], _policy("full", bb), retention=1.0, max_new_tokens=4, **path)
    assert dict(out)[1].tokens == solo.tokens
    assert pool.used_blocks == 0


def test_expected_new_tokens_knob():
    from wnw_exp.engine.serve import expected_new_tokens

    req = Request(0, None, 50)
    assert expected_new_tokens(req) == 30  # 0.6 of the cap by default
    assert expected_new_tokens(Request(0, None, 50, expected_new_tokens=20)) == 20
    assert expected_new_tokens(Request(0, None, 50, expected_new_tokens=90)) == 50  # never past the cap
    assert expected_new_tokens(req, 0) == 0 and expected_new_tokens(req, 70) == 50 and expected_new_tokens(req, 1.0) == 50
    with pytest.raises(ValueError, match="fraction of the cap"):
        expected_new_tokens(req, 1.5)


@pytest.mark.parametrize("in_pool", [True, False])
def test_attention_layout_addresses_every_key_of_the_store(in_pool):
    """`attention_layout()` is all a step needs to find a placed store's keys: each resident audio position p of
    (layer, head) at row audio_off + its slot, inside the head's caps; each dense token t (in a pool) at
    block_table[layer, head, t // page] + t % page. Checked against the keys written at prefill."""
    from wnw_exp.kv.packed import PackedAudioKVStore
    from wnw_exp.kv.reference import AudioKVStore

    assert AudioKVStore(1, 1, 4, 3, torch.device("cpu"), torch.float32, 2).pool is None  # every store answers
    torch.manual_seed(0)
    L, H, D, N, pre, post = 2, 3, 8, 40, 5, 3
    pool = KVPool(4096, D, torch.float32, "cpu", block=4) if in_pool else None
    if in_pool:
        pool.alloc(12)  # the store's rows do not start at pool row 0
    st = PackedAudioKVStore(L, H, D, N, torch.device("cpu"), torch.float32, dense_capacity=6, kernels="torch",
                            pool=pool, host_mirror=True)
    assert st.pool is pool and st.kernels == "torch"
    ks = [torch.randn(H, pre + N + post, D) for _ in range(L)]
    keep = {}
    for li in range(L):
        st.write_prefill(li, ks[li], torch.randn_like(ks[li]), (pre, pre + N))
        for h in range(H):
            keep[li, h] = torch.randperm(N)[: 4 + 7 * h].sort().values
            st.set_tiers(li, h, keep[li, h], torch.arange(N) if h == 1 else None)
    st.compact(headroom=3)
    lay = st.attention_layout()
    rows_k = pool.k if in_pool else st.audio_k
    assert lay.caps.tolist() == [[4, 11 + 3, 18]] * L and lay.max_audio_per_head == 18
    assert lay.dense_rows_max == pre + post + 6 and lay.audio_len.tolist() == [[4, 11, 18]] * L
    assert int(lay.dense_len) == pre + post and (lay.block_table is not None) == in_pool
    regions = sorted((int(lay.audio_off[li, h]), int(lay.caps[li, h])) for li in range(L) for h in range(H))
    assert all(a + c <= b for (a, c), (b, _) in zip(regions, regions[1:]))  # the heads' regions do not overlap
    dense = [torch.cat([k[:, :pre], k[:, pre + N:]], dim=1) for k in ks]
    for li in range(L):
        for h in range(H):
            p = keep[li, h]
            slot = st.slot_of[li * H + h, p].long()
            assert bool((slot >= 0).all() and (slot < lay.caps[li, h]).all())
            torch.testing.assert_close(rows_k[int(lay.audio_off[li, h]) + slot], ks[li][h, pre + p], rtol=0, atol=0)
            if in_pool:
                t = torch.arange(pre + post)
                row = lay.block_table[li, h, t // pool.block].long() + t % pool.block
                torch.testing.assert_close(pool.k[row], dense[li][h], rtol=0, atol=0)
    if in_pool:  # a page the store is given later shows in the same table
        assert st.ensure_dense(pre + post + 4)
        assert bool((lay.block_table[:, :, (pre + post + 3) // pool.block] > 0).all())


def test_pool_alloc_blocks():
    pool = KVPool(640, 8, torch.float32, "cpu", block=64)  # 10 blocks
    a = pool.alloc(130)  # blocks 0-2
    got = pool.alloc_blocks(4)
    assert [e.block for e in got] == [3, 4, 5, 6] and all(e.n_blocks == 1 and e.n_rows == 64 for e in got)
    assert pool.free_blocks == 3 and pool.alloc_blocks(4) is None and pool.free_blocks == 3  # all or nothing
    pool.free(got[1])
    pool.free(got[3])
    assert [e.block for e in pool.alloc_blocks(4)] == [4, 6, 7, 8]  # scattered: lowest free blocks first
    assert pool.free_blocks == 1


def test_chunked_prefill_interleaves_with_decoding_and_changes_nothing():
    bb = _backbone("voxtral")
    solo, batched, stats = _solo_and_batched(bb, "wnw", dict(store="reference"), prefill_chunk_layers=1)
    n_layers = bb.n_layers
    assert len(stats.prefill_ms_between_steps) == 2 * n_layers  # two admissions while another stream decodes
    for i, a in enumerate(solo):
        assert batched[i].tokens == a.tokens and batched[i].trace == a.trace


def test_arrivals_are_waited_for_and_every_wall_second_has_one_part():
    """Requests arriving over time: none starts before it arrives, an idle loop waits (no busy spin), results stay
    bs 1's; the wall parts (`BatchStats.wall_s`) add up to the wall the caller saw, each part measured, not derived."""
    import time

    from wnw_exp.engine.serve import WALL_PARTS

    bb = _backbone("voxtral")
    path = dict(store="packed", fused=True, kernels="torch")
    prompts, caps = _prompts(bb, (10.0, 8.0, 9.0)), (6, 4, 5)
    solo = [generate(bb, p, _policy("wnw", bb), retention=0.2, max_new_tokens=c, **path) for p, c in zip(prompts, caps)]
    # the third arrives long after the first two have finished: the loop has nothing to do until then
    arrivals = (0.0, 0.05, 3.0)
    reqs = [Request(i, p, c, arrival_s=a) for i, (p, c, a) in enumerate(zip(prompts, caps, arrivals))]
    pool = KVPool(100_000, bb.head_dim, bb.dtype, bb.device)
    stats = BatchStats()
    t0 = time.perf_counter()
    got = {}
    for key, res in decode_batch(bb, reqs, _policy("wnw", bb).fork, retention=0.2, pool=pool, stats=stats, **path):
        got[key] = res
        time.sleep(0.02)  # the caller's own work (writing a prediction) is its part, not the engine's
    wall = time.perf_counter() - t0
    for i in range(3):
        assert got[i].tokens == solo[i].tokens
        first = stats.first_token_at[i] - stats.started_at
        assert first >= arrivals[i]  # nothing runs before its arrival
        assert stats.emitted_at[i][0] == stats.first_token_at[i]
    assert set(stats.wall_s) <= set(WALL_PARTS)
    assert sum(stats.wall_s.values()) == pytest.approx(wall, rel=0.02, abs=0.005)
    assert stats.wall_s["caller"] >= 3 * 0.02
    finished_two = max(stats.emitted_at[0][-1], stats.emitted_at[1][-1]) - stats.started_at
    assert stats.wall_s["wait"] == pytest.approx(arrivals[2] - finished_two, abs=0.25)  # the idle gap, slept
    assert stats.wall_s["step"] * 1e3 == pytest.approx(sum(stats.step_ms), rel=1e-6)
    for part in ("setup", "prefill", "place", "grow", "emit", "finish"):
        assert stats.wall_s[part] > 0
    # the placements' parts, each measured, together inside the admissions' 'place' time
    from wnw_exp.engine.decode import PLACE_PARTS

    assert set(stats.place_s) == set(PLACE_PARTS) and all(v > 0 for v in stats.place_s.values())
    assert sum(stats.place_s.values()) <= stats.wall_s["place"]


@pytest.mark.parametrize("freeze", [True, False])
def test_the_collector_is_timed_and_frozen_only_while_the_loop_runs(freeze):
    """`decode_batch` times every pass of the garbage collector made while it runs (the caller's between yields
    too) and, with `freeze_gc`, keeps the objects alive at its start out of the passes until it ends (nothing stays
    frozen after it); the results do not change."""
    import gc

    bb = _backbone("voxtral")
    path = dict(store="packed", fused=True, kernels="torch")
    prompts = _prompts(bb, (8.0, 6.0))
    solo = [generate(bb, p, _policy("full", bb), retention=1.0, max_new_tokens=4, **path) for p in prompts]
    gc.collect()  # (Python 3.12 counts objects that a full pass leaves in its permanent generation as frozen)
    base = gc.get_freeze_count()
    stats, frozen, got = BatchStats(), [], {}
    for key, res in decode_batch(bb, [Request(i, p, 4) for i, p in enumerate(prompts)], _policy("full", bb).fork,
                                 retention=1.0, pool=KVPool(100_000, bb.head_dim, bb.dtype, bb.device), stats=stats,
                                 freeze_gc=freeze, **path):
        got[key] = res
        frozen.append(gc.get_freeze_count())
        gc.collect()  # a full pass, timed
    gc.collect()
    assert gc.get_freeze_count() == base
    assert all(n > base for n in frozen) if freeze else all(n == base for n in frozen)
    assert stats.gc_passes >= 2 and stats.gc_s > 0 and 0 < stats.gc_max_ms <= stats.gc_s * 1e3
    assert [got[i].tokens for i in range(2)] == [a.tokens for a in solo]
    gc.collect()
    passes = stats.gc_passes
    gc.collect()  # after the loop ended: no longer counted
    assert stats.gc_passes == passes


@pytest.mark.parametrize("method,host", [("full", False), ("adakv", False), ("wnw", True), ("arkvale", True)])
@torch.no_grad()
def test_only_a_method_with_a_cpu_tier_keeps_a_host_mirror(method, host):
    """The packed store pins a host copy of the prompt's audio KV (2 x L x H_kv x N x D values) only for a method
    that offloads (`Policy.cpu_tier`); such a store refuses a placement that offloads, naming the fix."""
    from wnw_exp.engine.decode import Stream, decode_path

    bb = _backbone("voxtral")
    policy = _policy(method, bb)
    st = Stream(bb, _prompts(bb, (10.0,))[0], policy, retention=0.2, max_new_tokens=4,
                path=decode_path(bb.device, policy, "packed", True, False, "torch"))
    st.prefill()
    assert (st.store.host_k is not None) == host == policy.cpu_tier
    assert st.store.summary()["r_gpu_cpu"] >= st.store.summary()["r_gpu"]
    if method == "wnw":  # only the rows it offloads: the placed tidal heads', read from its placement
        H = st.ctx.n_kv_heads
        offloading = sorted(li * H + k for (li, k), pos in policy.offloaded.items() if len(pos))
        mirrored = np.flatnonzero(st.store.host_row >= 0).tolist()
        assert set(offloading) <= set(mirrored) and len(mirrored) < st.store.host_row.size
        assert mirrored == sorted(li * H + k for li, k in policy.tidal if policy.retention[li, k] < 1)
    if not host:
        n = st.store.n_audio
        with pytest.raises(ValueError, match="no host tier.*cpu_tier = True"):
            st.store.set_tiers_block(0, torch.ones(1, n, dtype=torch.bool), torch.ones(1, n, dtype=torch.bool))


def test_the_host_arena_hands_out_disjoint_views_takes_them_back_and_falls_back_when_full():
    """`KVPool(host_bytes=)`: host mirrors are views of one arena made with the pool, by size (first fit over
    `HOST_UNIT`-byte units); given back they go back to it; where it has no room a buffer is pinned on its own (and
    kept for its shape). Against a unit-by-unit occupancy map, over random asks and gives: a buffer comes from the
    arena exactly when a free run long enough exists, at the lowest such run, and no two live buffers overlap."""
    import random

    from wnw_exp.kv.pool import HOST_UNIT

    with pytest.raises(ValueError, match="host_bytes must be >= 0"):
        KVPool(640, 8, torch.float32, "cpu", host_bytes=-1)
    assert KVPool.of_bytes(1e6, 8, torch.float32, "cpu", host_bytes=3 * HOST_UNIT).stats()["host_arena_bytes"] \
        == 3 * HOST_UNIT
    pool = KVPool(640, 8, torch.float32, "cpu", host_bytes=4 * HOST_UNIT + 100)  # 4 units (whole units only)
    arena = pool.host_arena
    a = pool.host_buffer((3, 1000, 8), torch.float32)  # 96,000 bytes: units 0-1
    b = pool.host_buffer((10,), torch.bfloat16)  # unit 2
    c = pool.host_buffer((2, 70_000), torch.uint8)  # 3 units: no room, pinned on its own
    assert a.shape == (3, 1000, 8) and a.dtype == torch.float32 and b.dtype == torch.bfloat16
    assert a.data_ptr() == arena.data_ptr() and b.data_ptr() == arena.data_ptr() + 2 * HOST_UNIT
    assert c.untyped_storage().data_ptr() != arena.untyped_storage().data_ptr()
    a.fill_(1.0), b.fill_(2.0)
    assert bool((a == 1.0).all()) and bool((b == 2.0).all())
    st = pool.stats()
    assert (st["host_arena_bytes"], st["host_arena_used_bytes"], st["host_pinned_outside"]) == (4 * HOST_UNIT,
                                                                                                 3 * HOST_UNIT, 1)
    pool.give_host(a)
    assert pool.host_buffer((5, 4000), torch.float32).data_ptr() == arena.data_ptr()  # a's units, another shape
    pool.give_host(b)
    with pytest.raises(RuntimeError, match="given back twice"):
        pool.give_host(b)
    pool.give_host(c)
    assert pool.host_buffer((2, 70_000), torch.uint8) is c  # no room in the arena: c, kept for its shape
    assert pool.stats()["host_pinned_outside"] == 1

    rng = random.Random(0)
    n_units = 24
    pool = KVPool(640, 8, torch.float32, "cpu", host_bytes=n_units * HOST_UNIT)
    base = pool.host_arena.data_ptr()
    occupied = [False] * n_units  # the independent map: which units are taken
    live = []  # (buffer, first unit, units) of the arena's live buffers
    for _ in range(400):
        if live and rng.random() < 0.45:
            buf, u, n = live.pop(rng.randrange(len(live)))
            pool.give_host(buf)
            occupied[u:u + n] = [False] * n
            continue
        nbytes = rng.randrange(1, 6 * HOST_UNIT) // 4 * 4 + 4
        need = -(-nbytes // HOST_UNIT)
        runs = [u for u in range(n_units - need + 1) if not any(occupied[u:u + need])]
        buf = pool.host_buffer((nbytes // 4,), torch.float32)
        inside = buf.untyped_storage().data_ptr() == pool.host_arena.untyped_storage().data_ptr()
        assert inside == bool(runs)
        if inside:
            u = (buf.data_ptr() - base) // HOST_UNIT
            assert (buf.data_ptr() - base) % HOST_UNIT == 0 and u == runs[0]  # first fit
            occupied[u:u + need] = [True] * need
            live.append((buf, u, need))
        else:
            pool.give_host(buf)
        spans = sorted((x.data_ptr(), x.data_ptr() + x.numel() * 4) for x, _, _ in live)
        assert all(e <= s2 for (_, e), (s2, _) in zip(spans, spans[1:]))  # no two live buffers overlap
        assert pool.stats()["host_arena_used_bytes"] == sum(occupied) * HOST_UNIT


def test_wnw_streams_take_their_host_mirrors_from_the_arena_and_decode_as_alone():
    """Two WnW streams at once, their host mirrors views of the pool's host arena (none pinned on its own), decode
    exactly as each alone (the mirrors do not overlap), and give the arena back when they leave."""
    bb = _backbone("voxtral")
    pool = KVPool(100_000, bb.head_dim, bb.dtype, bb.device, host_bytes=1 << 26)
    path = dict(store="packed", fused=True, kernels="torch")
    solo, got, stats = _solo_and_batched(bb, "wnw", path, pool=pool, caps=(5, 6), seconds=(9.0, 12.0))
    assert max(stats.batch_sizes) == 2
    for i in range(2):
        assert got[i].tokens == solo[i].tokens and got[i].trace == solo[i].trace
        assert got[i].store_summary["mb_per_step"] > 0  # (it recalled from its mirror)
    st = pool.stats()
    assert st["host_pinned_outside"] == 0 and st["host_arena_used_bytes"] == 0 < st["host_arena_peak_bytes"]


def test_the_pool_recycles_host_mirrors_and_results_stay_bs1s():
    """A leaving stream's host mirror goes back to the pool and the next stream of that shape gets it (nothing new is
    pinned); two WnW streams one after the other through one recycled mirror decode exactly as each alone."""
    bb = _backbone("voxtral")
    pool = KVPool(100_000, bb.head_dim, bb.dtype, bb.device)
    a = pool.host_buffer((3, 4, 8), torch.float32)
    pool.give_host(a)
    assert pool.host_buffer((3, 4, 8), torch.float32) is a  # recycled
    assert pool.host_buffer((3, 4, 8), torch.float32) is not a  # (it was taken: a new one)
    assert pool.host_buffer((3, 4, 8), torch.bfloat16).dtype == torch.bfloat16
    path = dict(store="packed", fused=True, kernels="torch")
    solo, got, stats = _solo_and_batched(bb, "wnw", path, pool=pool, caps=(5, 6), seconds=(9.0, 9.0),
                                         max_concurrent=1)
    assert max(stats.batch_sizes) == 1
    for i in range(2):
        assert got[i].tokens == solo[i].tokens and got[i].trace == solo[i].trace


def test_a_stream_whose_step_fails_fails_alone():
    from wnw_exp.methods.base import Policy

    class FailsAtStep2(Policy):
        def after_step(self, step):
            if step == 2:
                raise RuntimeError("boom")

    bb = _backbone("voxtral")
    prompts = _prompts(bb)
    forks = iter([Policy(), FailsAtStep2(), Policy()])
    out = dict(decode_batch(bb, [Request(i, p, c) for i, (p, c) in enumerate(zip(prompts, CAPS))], lambda: next(forks),
                            retention=1.0, store="reference"))
    assert isinstance(out[1], RuntimeError) and str(out[1]) == "boom"
    for i in (0, 2):
        assert out[i].tokens == generate(bb, prompts[i], Policy(), retention=1.0, max_new_tokens=CAPS[i],
                                         store="reference").tokens


def test_pool_allocator():
    pool = KVPool(640, 8, torch.float32, "cpu", block=64)  # 10 blocks
    assert pool.k.shape == (640, 8) and pool.capacity_bytes == 640 * 8 * 4 * 2
    a, b, c = pool.alloc(100), pool.alloc(64), pool.alloc(250)  # 2 + 1 + 4 blocks
    assert (a.block, b.block, c.block) == (0, 2, 3) and pool.used_blocks == 7
    assert pool.alloc(200) is None and pool.n_refused == 1  # 3 blocks left, 4 needed
    pool.free(b)
    assert pool.alloc(193) is None  # 1 + 3 free blocks, not adjacent
    pool.free(a)  # merges with b's block: 3 free at 0, 3 at 7
    d = pool.alloc(192)
    assert d.block == 0 and pool.peak_blocks == 7
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(a)
    for x in (c, d):
        pool.free(x)
    assert pool.used_blocks == 0 and pool.free_blocks == 10
    whole = pool.alloc(10 * 64)  # the free runs merged back into one: the whole pool in one extent, from block 0
    assert whole is not None and whole.block == 0


def test_pool_free_many_leaves_the_free_list_of_one_free_at_a_time():
    """A leaving stream gives back its extent and its scattered pages in one pass (`free_many`): the free runs, the
    counts and what later allocations get are those of freeing each extent on its own; a bad extent frees none."""
    rng = np.random.default_rng(0)
    for trial in range(20):
        pools = [KVPool(64 * 200, 4, torch.float32, "cpu", block=64) for _ in range(2)]
        held = [[], []]
        for _ in range(30):  # the same allocations in both pools
            if rng.random() < 0.5:
                n = int(rng.integers(1, 400))
                got = [p.alloc(n) for p in pools]
                got = [[g] if g is not None else [] for g in got]
            else:
                n = int(rng.integers(1, 12))
                got = [p.alloc_blocks(n) or [] for p in pools]
            for h, g in zip(held, got):
                h.append(g)
        leaving = rng.permutation(len(held[0]))[:15]
        for i in leaving:  # one stream's extents at once, against one at a time
            pools[0].free_many(held[0][i])
            for e in held[1][i]:
                pools[1].free(e)
        assert pools[0]._blocks.runs == pools[1]._blocks.runs
        assert pools[0].used_blocks == pools[1].used_blocks and pools[0].peak_blocks == pools[1].peak_blocks
        assert [e.block for e in pools[0].alloc_blocks(7) or []] == [e.block for e in pools[1].alloc_blocks(7) or []]
    pool = KVPool(640, 8, torch.float32, "cpu", block=64)
    a, b = pool.alloc(64), pool.alloc(64)
    pool.free(a)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free_many([b, a])
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free_many([b, b])
    assert pool.used_blocks == 1  # b was not freed either


def test_bad_max_concurrent():
    bb = _backbone("voxtral")
    with pytest.raises(ValueError, match="at least 1"):
        list(decode_batch(bb, [], _policy("full", bb).fork, retention=1.0, max_concurrent=0))


# --- the batched Triton kernels --------------------------------------------------------------------------
def _triton_device():
    if not HAS_TRITON:
        pytest.skip("triton is not installed (optional `gpu` extra)")
    if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported without TRITON_INTERPRET=1 and there is no CUDA")
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.mark.parametrize("G,max_tiles", [(1, None), (4, None), (4, 3), (1, 2)])
def test_batched_ragged_attention_kernel_matches_dense_attention(G, max_tiles, monkeypatch):
    """The batched kernel reads each (stream, KV head)'s dense tokens through its page table (pages scattered over
    the pool, in no order, a dense length spanning several pages and ending inside one) and its audio slots. With
    `max_tiles` the split-K is the one of a large batch (one program a head, its walk capped), each head then
    spreading its own keys over fewer programs than it has tiles."""
    dev = _triton_device()
    from wnw_exp.kv import triton_attention
    from wnw_exp.kv.packed import attention_batched_torch, observed_probs_torch
    from wnw_exp.kv.triton_attention import decode_attention_batched, observed_probs

    if max_tiles is not None:
        plain = triton_attention.n_splits_for
        monkeypatch.setattr(triton_attention, "MAX_TILES_PER_PROGRAM", max_tiles)
        monkeypatch.setattr(triton_attention, "n_splits_for", lambda k, h: plain(k, h, target_programs=1))

    torch.manual_seed(0)
    B, H, D, C, page = 3, 2, 32, 2000, 4
    pk, pv = torch.randn(C, D) * 3, torch.randn(C, D)
    pos = torch.full((C,), -1, dtype=torch.int32)
    table = (torch.randperm(75)[: B * H * 4].view(B, H, 4) * page).int()  # 4 pages each in rows [0, 300)
    dlen = torch.tensor([5, 1, 13])
    aoff = torch.tensor([[300, 500], [700, 900], [1100, 1300]])
    alen = torch.tensor([[150, 0], [37, 64], [1, 190]], dtype=torch.int32)  # ragged, one head empty
    for b in range(B):
        for h in range(H):
            n = int(alen[b, h])
            p = torch.randperm(400)[:n].int()
            p[torch.rand(n) < 0.2] = -1  # free slots inside the scanned rows: garbage keys to skip
            pos[aoff[b, h]: aoff[b, h] + n] = p
    q = torch.randn(B, H * G, D)
    max_keys = int((dlen[:, None] + alen).max())
    args = [x.to(dev) for x in (q, pk, pv, pos, table, dlen, aoff, alen)]
    out, lse = decode_attention_batched(*args, 0.2, max_keys=max_keys, page_rows=page)
    out_t, lse_t = attention_batched_torch(*args, 0.2, max_keys=max_keys, page_rows=page)
    tol = 5e-3 if HAS_CUDA else 1e-4  # tf32 on CUDA
    for b in range(B):
        for h in range(H):
            rows = [int(table[b, h, i // page]) + i % page for i in range(dlen[b])]
            rows += [r for r in range(aoff[b, h], aoff[b, h] + alen[b, h]) if pos[r] >= 0]
            w = torch.softmax(q[b, h * G:(h + 1) * G] @ pk[rows].T * 0.2, -1)
            torch.testing.assert_close(out[b, h * G:(h + 1) * G].cpu(), w @ pv[rows], atol=tol, rtol=tol)
            torch.testing.assert_close(out_t[b, h * G:(h + 1) * G].cpu(), w @ pv[rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu(), lse_t.cpu(), atol=tol, rtol=tol)
    obs = torch.tensor([0, H * G - 1], dtype=torch.int32, device=dev)
    p1, p2 = torch.zeros(2, 400, device=dev), torch.zeros(2, 400, device=dev)
    observed_probs(args[0][2], args[1], args[3], args[6][2], args[7][2], lse[2], 0.2, obs, p1, 190)
    observed_probs_torch(args[0][2], args[1], args[3], args[6][2], args[7][2], lse_t[2], 0.2, obs, p2, 190)
    torch.testing.assert_close(p1.cpu(), p2.cpu(), atol=tol / 10, rtol=tol)
    assert float(p1.sum()) > 0
    # streams 0 and 2 summing their observers' weights into their own accumulators, in one launch (ObserverSum:
    # each key found through the stream's slot_of) = the weights of observed_probs, summed, added
    from wnw_exp.kv.triton_attention import ObserverSum

    entries, want = [], []
    for b, heads in ((0, [0, H * G - 1]), (2, [H * G - 1, 1, 0])):
        slot_of = torch.full((H, 400), -1, dtype=torch.int32)
        for h in range(H):
            p_h = pos[aoff[b, h]: aoff[b, h] + alen[b, h]]
            ok = p_h >= 0
            slot_of[h, p_h[ok].long()] = torch.arange(int(alen[b, h]), dtype=torch.int32)[ok]
        acc = torch.full((400,), 0.25, device=dev)
        entries.append((b, acc, slot_of.to(dev), heads))
        w = torch.zeros(len(heads), 400, device=dev)
        observed_probs_torch(args[0][b], args[1], args[3], args[6][b], args[7][b], lse_t[b], 0.2,
                             torch.tensor(heads, dtype=torch.int32, device=dev), w, 190)
        want.append(0.25 + w.sum(0))
    ObserverSum(entries, dev)(args[0], args[1], args[6], lse, 0.2)
    for (_, acc, _, _), ref in zip(entries, want):
        torch.testing.assert_close(acc.cpu(), ref.cpu(), atol=tol / 10, rtol=tol)


def test_batched_rope_append_writes_through_the_page_table():
    """RoPE + append of a batch (the Triton kernel where installed, and its PyTorch equivalent): each stream's new
    key and value land at its dense token dense_len[b] of its page table, nowhere else."""
    from wnw_exp.engine.step import rope_append_batched_torch

    torch.manual_seed(1)
    B, HQ, H, D, C, page, T = 2, 4, 2, 16, 200, 4, 10
    qkv = torch.randn(B, (HQ + 2 * H) * D)
    cos, sin = torch.randn(B, T, D), torch.randn(B, T, D)
    t, dlen = torch.tensor([3, 7]), torch.tensor([5, 8])  # token 5: page 1, row 1; token 8: page 2, row 0
    table = (torch.randperm(C // page)[: B * H * 3].view(B, H, 3) * page).int()
    impls = [rope_append_batched_torch]
    if HAS_TRITON and (HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1"):
        from wnw_exp.engine.triton_ops import rope_append_batched
        impls.append(rope_append_batched)
    dev = torch.device("cuda" if HAS_CUDA else "cpu")
    got = []
    for fn in impls:
        pk, pv, q = torch.zeros(C, D, device=dev), torch.zeros(C, D, device=dev), torch.empty(B, HQ, D, device=dev)
        fn(*(x.to(dev) for x in (qkv, cos, sin, t, dlen, table)), q, pk, pv, HQ, H, D, page_rows=page)
        got.append((q.cpu(), pk.cpu(), pv.cpu()))
        x = qkv.view(B, HQ + 2 * H, D)
        for b in range(B):
            rows = [int(table[b, h, dlen[b] // page]) + int(dlen[b]) % page for h in range(H)]
            torch.testing.assert_close(pv[rows].cpu(), x[b, HQ + H:])
            assert int((pk.cpu().abs().sum(1) > 0).sum()) == B * H  # one row per (stream, KV head), nowhere else
    for q2, k2, v2 in got[1:]:
        torch.testing.assert_close(q2, got[0][0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(k2, got[0][1], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(v2, got[0][2])


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not HAS_CUDA, reason="bf16 kernels on CUDA"))])
def test_batched_step_in_triton_matches_bs1(dtype, monkeypatch):
    """The whole batched step with its Triton kernels (WnW: observers, recalls; every stream's store flushed in one
    pair of launches, `flush_stores`) against bs 1 on the same kernels (on CUDA: with their CUDA graphs). bf16: the
    same tokens while the logits agree (near-ties may part them)."""
    import wnw_exp.kv.packed as packed

    dev = _triton_device()
    interpreted_prefill_in_torch(monkeypatch)
    flushes = []  # per batched flush: (its stores, their movable rows, the stores' rows its tables flush)

    def counted(stores, held=None, launch=True):
        packed_flush(stores, held, launch)
        if launch:  # (launch=False builds a composition's tables before its capture)
            flushes.append((len(stores), sum(len(s._flush_blocks()[None]["host_rows"]) for s in stores),
                            held["tables"].n_store_rows))

    packed_flush = packed.flush_stores
    monkeypatch.setattr(packed, "flush_stores", counted)
    bb = _backbone("voxtral")
    bb.model.to(dev, dtype)
    path = dict(store="packed", fused=True, kernels="triton")
    pool = KVPool(50_000, bb.head_dim, bb.dtype, dev)
    caps = (4, 3) if not HAS_CUDA else (12, 9)
    solo, batched, stats = _solo_and_batched(bb, "wnw", path, pool=pool, caps=caps, seconds=(8.0, 6.0))
    assert max(stats.batch_sizes) == 2
    assert any(n == 2 for n, _, _ in flushes) and all(rows == n_rows > 0 for _, rows, n_rows in flushes)
    if not HAS_CUDA:  # one flush a step (a CUDA graph replays its steps' flushes without calling flush_stores)
        assert len(flushes) == len(stats.batch_sizes)
        assert stats.step_kinds == ["eager"] * len(stats.batch_sizes)
    else:  # each composition: WARM_STEPS eager steps, its capture, then replays
        assert len(stats.step_kinds) == len(stats.batch_sizes)
        assert {"eager", "capture", "replay"} <= set(stats.step_kinds)
    # Triton's fp32 dots run as tf32 on CUDA, tiled differently in the two kernels; bf16 rounds every GEMM
    tol = 1e-4 if not HAS_CUDA else 5e-3 if dtype == torch.float32 else 0.1
    for i, a in enumerate(solo):
        b = batched[i]
        same = next((k for k, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), len(a.tokens))
        if dtype == torch.float32:
            assert same == len(a.tokens) == len(b.tokens) and b.trace == a.trace
        assert same >= 1
        assert max(float((x - y).abs().max()) for x, y in zip(a.logits[:same], b.logits[:same])) < tol


@pytest.mark.parametrize("method", ["full", "wnw"])
def test_a_bucket_step_and_its_tables_serve_every_composition_that_fits(method, monkeypatch):
    """With the Triton kernels a batch runs in its bucket's step (`BatchedFusedStep` with a capacity): a join or a
    leave seats the new composition in place (`bind`), so one step per bucket is made, its launch tables are
    rewritten rather than made anew (the addresses a CUDA graph holds stay valid), the runner (and graph) of a
    composition shape is made once, and every stream still gives bs 1's tokens, logits and traces."""
    import wnw_exp.engine.decode as decode
    from wnw_exp.engine.step import BatchedFusedStep

    dev = _triton_device()
    interpreted_prefill_in_torch(monkeypatch)
    made, runners = [], []
    init, runner_init = BatchedFusedStep.__init__, decode.TokenRunner.__init__
    monkeypatch.setattr(BatchedFusedStep, "__init__", lambda self, *a, **k: (made.append(k.get("capacity")),
                                                                             init(self, *a, **k))[1])
    monkeypatch.setattr(decode.TokenRunner, "__init__", lambda self, step, *a, **k: (
        runners.append(isinstance(step, BatchedFusedStep)), runner_init(self, step, *a, **k))[1])
    bb = _backbone("voxtral")
    bb.model.to(dev)
    path = dict(store="packed", fused=True, kernels="triton")
    pool = KVPool(50_000, bb.head_dim, bb.dtype, dev)
    caps, seconds = (6, 3, 5, 4), (8.0, 6.0, 7.0, 6.0)
    solo, batched, stats = _solo_and_batched(bb, method, path, pool=pool, caps=caps, seconds=seconds,
                                             max_concurrent=2)
    compositions = 1 + sum(stats.step_build_ms[j] > 0 for j in range(1, len(stats.step_build_ms)))
    assert max(stats.batch_sizes) == 2 and compositions >= 4
    assert sorted(made) == [1, 2]  # one step per bucket, however often the batch changed
    assert sum(runners) == 2 < compositions  # one runner (and graph) per bucket and shape
    for i, a in enumerate(solo):
        b = batched[i]
        assert b.tokens == a.tokens and b.trace == a.trace and b.store_summary == a.store_summary
        assert max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits)) < 1e-4
    assert pool.used_blocks == 0


def test_bucket_sizes():
    from wnw_exp.engine.decode import BUCKETS, bucket_for

    assert [bucket_for(n) for n in (1, 2, 3, 5, 9, 13, 33, 64, 65, 130)] == [1, 2, 4, 8, 12, 16, 40, 64, 128, 192]
    assert all(bucket_for(b) == b for b in BUCKETS)


def test_batched_step_in_triton_on_a_paged_pool_with_preemption(monkeypatch):
    """The whole batched step with its Triton kernels (WnW) on a pool of 4-row blocks with room for the two streams'
    placed KV and one dense page more: a page given mid-answer to the first, the second (the newest) preempted when
    it needs one and restarted alone; both give bs 1's tokens and traces on the same kernels. The prefill runs between
    the steps on CUDA too (the scenario rests on the step the second stream joins at, which an overlapped prefill
    moves by the turns its forward pass and its placement take: `test_overlap_prefill` covers that path)."""
    dev = _triton_device()
    interpreted_prefill_in_torch(monkeypatch)
    bb = _backbone("voxtral")
    bb.model.to(dev)
    path = dict(store="packed", fused=True, kernels="triton")
    seconds, caps = (8.0, 6.0), (6, 5)
    placed = _placed_blocks(bb, "wnw", dict(store="packed", fused=True, kernels="torch"), _prompts(bb, seconds))
    pool = KVPool((sum(placed) + bb.n_layers * bb.n_kv_heads) * 4, bb.head_dim, bb.dtype, dev, block=4)
    calls = _counting_page_allocs(pool)
    solo, batched, stats = _solo_and_batched(bb, "wnw", path, pool=pool, caps=caps, seconds=seconds, reserve_tokens=0,
                                             overlap_prefill=False)
    assert max(stats.batch_sizes) == 2 and stats.preempted == [1]
    assert len(calls) > 2 * 3  # a page beyond the prompts' (2 each, three admissions)
    tol = 1e-4 if not HAS_CUDA else 5e-3
    for i, a in enumerate(solo):
        b = batched[i]
        assert b.tokens == a.tokens and b.trace == a.trace
        assert max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits)) < tol
    assert pool.used_blocks == 0


# --- wnw-run batch_size ----------------------------------------------------------------------------------
def _run_config(tmp_path, *overrides):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    conf = str(conf_dir())
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = compose("config", overrides=["model=tiny_random", "dataset.min_seconds=3", "dataset.max_seconds=9",
                                           f"dataset.cache_dir={tmp_path / 'cache'}", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


@pytest.mark.parametrize("pooled", [False, True], ids=["default-path", "packed-pool"])
@pytest.mark.parametrize("method", ["wnw", "arkvale"])
def test_wnw_run_batch_size_gives_the_bs1_predictions_and_resumes(tmp_path, monkeypatch, method, pooled):
    """`wnw-run batch_size=8` over 10 samples (streams leave and others join) = batch size 1, byte for byte: the
    predictions, the metrics and every per-sample trace; a run cut after one sample resumes. On the device's default
    path and (`pooled`, on the CPU) on the GPU's route with PyTorch kernels: batch size 1 on the packed store and
    the fused step, batch size 8 on a KV pool stepped by one batched step."""
    from wnw_exp.engine import runner, serve
    from wnw_exp.engine.runner import run
    from wnw_exp.kv.pool import KVPool
    from wnw_exp.rundir import identity_hash

    if pooled:
        if HAS_CUDA:
            pytest.skip("the GPU's route runs in the default-path case on CUDA")
        monkeypatch.setitem(runner.ENGINE_PATHS, "auto", dict(store="packed", fused=True, kernels="torch"))
        monkeypatch.setattr(serve, "default_pool", lambda bb, *a, **k: KVPool(2_000_000, bb.head_dim, bb.dtype, bb.device))
        from wnw_exp.engine import decode

        made = []  # the streams each batched step was made for

        class Counted(decode.BatchedFusedStep):
            def __init__(self, backbone, streams, *a, **k):
                streams = list(streams)
                made.append(len(streams))
                super().__init__(backbone, streams, *a, **k)

        monkeypatch.setattr(decode, "BatchedFusedStep", Counted)

    cfg1 = _run_config(tmp_path, f"method={method}", "dataset.n=10")
    cfg8 = _run_config(tmp_path, f"method={method}", "dataset.n=10", "batch_size=8")
    assert identity_hash(cfg1) == identity_hash(cfg8)  # the same results, the same run directory
    m1 = run(cfg1, tmp_path / "bs1", progress=False)
    run({**cfg8, "dataset": {**cfg8["dataset"], "n": 1}}, tmp_path / "bs8", progress=False)  # a first sample, then resume
    m8 = run(cfg8, tmp_path / "bs8", progress=False)
    lines1 = (tmp_path / "bs1" / "predictions.jsonl").read_text().splitlines()
    lines8 = (tmp_path / "bs8" / "predictions.jsonl").read_text().splitlines()
    assert len(lines8) == 10 and sorted(lines8) == sorted(lines1)  # byte for byte (lines in the order samples finish)
    timing = {"ms_per_token", "prefill_ms"}  # wall clock: a batch's step is longer than one sample's
    assert {k: v for k, v in m8.items() if k not in timing} == {k: v for k, v in m1.items() if k not in timing}
    for i in range(10):
        name = f"synthetic-test-{i}.json"
        assert (tmp_path / "bs8" / "trace" / name).read_bytes() == (tmp_path / "bs1" / "trace" / name).read_bytes()
    if pooled:  # batch size 8 stepped its streams together, in one batched step on the pool
        assert made and max(made) > 1


def test_wnw_run_refuses_a_bad_batch_size_in_one_line(tmp_path):
    import subprocess

    from wnw_exp.engine.runner import check_config

    out = subprocess.run([sys.executable, "-m", "wnw_exp.cli.run", "batch_size=0", f"runs_root={tmp_path}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.splitlines() == ["wnw-run: error: batch_size=0: the number of samples decoded together, a "
                                       "whole number >= 1"]
    for bad in (-2, 1.5, "4", True):
        with pytest.raises(ValueError, match=f"^batch_size={bad!r}: the number of samples decoded together"):
            check_config({"retention": 0.2, "batch_size": bad})


def test_kv_pool_gb_is_checked_and_outside_the_identity(tmp_path):
    """`kv_pool_gb` (the GPU pool batched streams share; `kv_host_gb`, its host arena) takes a size > 0 or null, one line otherwise, and does not
    change the run directory (like batch_size, it cannot change a prediction)."""
    from wnw_exp.engine.runner import check_config
    from wnw_exp.rundir import identity_hash

    for bad in (0, -1.5, "4", True):
        with pytest.raises(ValueError, match=f"^kv_pool_gb={bad!r}: the KV pool batched streams share"):
            check_config({"retention": 0.2, "kv_pool_gb": bad})
    check_config({"retention": 0.2, "kv_pool_gb": 2.5})
    check_config({"retention": 0.2, "kv_pool_gb": None})
    for bad in (-1, "4", True):
        with pytest.raises(ValueError, match=f"^kv_host_gb={bad!r}: the pinned host memory"):
            check_config({"retention": 0.2, "kv_host_gb": bad})
    check_config({"retention": 0.2, "kv_host_gb": 0})
    assert identity_hash(_run_config(tmp_path, "kv_pool_gb=3.0", "batch_size=4", "kv_host_gb=8")) == \
        identity_hash(_run_config(tmp_path))


def test_kv_reserve_is_checked_reaches_admission_and_is_outside_the_identity(tmp_path, monkeypatch):
    """`kv_reserve` (the answer tokens a batched stream's admission keeps pool room for: tokens, a fraction of the
    cap, or null) gets one line for a bad value, reaches `decode_batch(reserve_tokens=)`, and does not change the
    run directory (admission decides when a stream runs, not what it predicts)."""
    from wnw_exp.engine import runner, serve
    from wnw_exp.methods.base import Policy
    from wnw_exp.rundir import identity_hash

    for bad in (-1, 1.5, -0.1, "4", True):
        with pytest.raises(ValueError, match=f"^kv_reserve={bad!r}: the answer tokens a batched stream"):
            runner.check_config({"retention": 0.2, "kv_reserve": bad})
    for good in (None, 0, 40, 0.0, 0.25, 1.0):
        runner.check_config({"retention": 0.2, "kv_reserve": good})
    assert identity_hash(_run_config(tmp_path, "kv_reserve=0.3")) == identity_hash(_run_config(tmp_path))
    seen = []

    def fake_decode_batch(backbone, requests, make_policy, **kw):
        seen.append(kw["reserve_tokens"])
        return iter(())

    monkeypatch.setattr(serve, "decode_batch", fake_decode_batch)
    for value in (None, 12, 0.5):
        runner._run_batched([], None, Policy(), dict(retention=1.0, batch_size=2, kv_reserve=value,
                                                     engine="reference"), lambda rec: None)
    assert seen == [None, 12, 0.5]


def test_serving_profile_rows_smoke(tmp_path):
    """serving.py --profile (where a batched step's time goes): one row per spec, the profiler run over the steps
    taken while all of its streams decode (on the CPU: ops, not kernels)."""
    import subprocess

    out = tmp_path / "profile.json"
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "benchmarks/serving.py"), "--smoke", "--profile",
                        "wnw:3:200,wnw:3:200:-flush+decide,adakv:2:200", "--profile-steps", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=240, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [(x["kind"], x["method"], x["streams"], x["steps"], x["ablate"]) for x in rows] == [
        ("profile", "wnw", 3, 2, None), ("profile", "wnw", 3, 2, "flush,decide"), ("profile", "adakv", 2, 2, None)]
    for x in rows:
        assert "error" not in x and x["top"] and any(t["launches_per_step"] > 0 for t in x["top"])
        assert x["step_ms_p50"] > 0 and x["step_ms_wall_p50"] > 0  # timed without, then with the profiler


def test_serving_scenario_warms_up_outside_its_clock(tmp_path):
    """serving.py's throughput rows: the warm-up runs before the clock (its time apart from the wall, the run's
    requests and tokens only the scenario's), every wall second in one part, the collector's passes counted; with
    --no-warmup none runs."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    rows = {}
    for flag in ([], ["--no-warmup", "--no-gc-freeze"]):
        out = tmp_path / f"serving{len(flag)}.json"
        r = subprocess.run([sys.executable, str(root / "benchmarks/serving.py"), "--smoke", "--methods", "full,wnw",
                            "--out", str(out), *flag], capture_output=True, text=True, timeout=240, cwd=root)
        assert r.returncode == 0, r.stderr[-2000:]
        rows[bool(flag)] = [x for x in json.loads(out.read_text()) if x["kind"] == "throughput"]
    for cold, got in rows.items():
        assert [x["method"] for x in got] == ["full", "wnw"]
        for x in got:
            assert "error" not in x and x["finished"] == x["requests"]
            assert x["tokens"] > 0
            parts = sum(v for k, v in x.items() if k.startswith("wall_s_"))
            assert parts == pytest.approx(x["wall_s"], rel=0.05, abs=0.01)
            assert x["gc_frozen"] is (not cold) and x["gc_passes"] >= 0 and x["gc_s"] >= 0
            assert (x["warmup_s"] < 0.05) if cold else (x["warmup_s"] > 0)
    # the same requests and answers whether warmed or not: the warm-up left nothing behind in the run
    assert [x["tokens"] for x in rows[False]] == [x["tokens"] for x in rows[True]]


def test_serving_ablations_patch_and_restore():
    """serving.py's --ablate diagnostic: each part replaces what it names while the row runs, and everything is put
    back after it (the next row runs the real code); an unknown part is refused with the choices."""
    import importlib.util

    from wnw_exp.kv import packed
    from wnw_exp.methods.base import Policy
    from wnw_exp.methods.wnw.policy import WnW

    path = Path(__file__).resolve().parents[1] / "benchmarks/serving.py"
    spec = importlib.util.spec_from_file_location("serving_bench", path)
    serving = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serving)
    before = (packed.flush_stores, packed.record_steps, Policy.__dict__["after_step_all"],
              WnW.__dict__["after_step_all"])
    restore = serving.ablated("flush,records,decide")
    assert packed.flush_stores is not before[0] and packed.record_steps is not before[1]
    assert WnW.__dict__["after_step_all"] is not before[3] and WnW.after_step_all([], [], {}) is None
    restore()
    assert (packed.flush_stores, packed.record_steps, Policy.__dict__["after_step_all"],
            WnW.__dict__["after_step_all"]) == before
    with pytest.raises(SystemExit, match="choose from"):
        serving.ablated("everything")


def test_serving_method_names_carry_options(tmp_path):
    """serving.py's method names may carry method options (`wnw:max_recalled=6+top_k=2`): the policy gets them, the
    row's target retention is its method's, and a name without options is the method's defaults."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks/serving.py"
    spec = importlib.util.spec_from_file_location("serving_bench", path)
    serving = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serving)
    info = dict(name="tiny_random_weights", n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=16,
                token_rate=serving.ds.TOKEN_RATE)
    scores = serving.ds.synthetic_head_scores(info, tmp_path / "scores.json")
    capped = serving.policy_for("wnw:max_recalled=6+top_k=2", info, scores, 200, 8)
    plain = serving.policy_for("wnw", info, scores, 200, 8)
    assert (capped.max_recalled, capped.top_k) == (6, 2) and (plain.max_recalled, plain.top_k) == (0, 3)
    assert serving.policy_for("adakv:window_size=4", info, scores, 200, 8).window_size == 4
    assert serving.target("wnw:max_recalled=6", 0.2) == 0.2 and serving.target("full", 0.2) == 1.0


def test_serving_benchmark_smoke(tmp_path):
    """benchmarks/serving.py --smoke: every method's row with the issue's schema, admission within the pool, and
    the 0.2-retention methods holding more streams than Full in the same pool."""
    import subprocess

    out = tmp_path / "serving.json"
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "benchmarks/serving.py"), "--smoke", "--out", str(out)],
                       capture_output=True, text=True, timeout=240, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())
    tput = {x["method"]: x for x in rows if x["kind"] == "throughput"}
    assert set(tput) == {"full", "wnw", "adakv", "arkvale", "wnw_recall_off"}
    schema = {"kind", "method", "retention", "audio_tokens", "kv_budget_gb", "max_concurrent", "tokens_per_s",
              "p50_ms", "p95_ms", "h2d_gb_per_s", "preempted", "date", "gpu", "command"}
    for x in tput.values():
        assert schema <= x.keys() and "error" not in x
        assert x["finished"] == x["requests"] == 6 and x["refused"] == 0
        assert x["pool_peak_gb"] <= x["pool_capacity_gb"] <= x["kv_budget_gb"]  # admission respected the pool
        assert x["tokens_per_s"] > 0 and x["p95_ms"] >= x["p50_ms"] > 0
        # the steady-state rate is the peak's streams over the peak's median step, give or take the spread
        assert 0.5 < x["tokens_per_s_at_peak"] * x["step_ms_p50_at_peak"] / 1e3 / x["max_concurrent"] < 2.0
        assert x["preempted"] >= 0 and x["expected_new_tokens"] == 6
        # the CPU smoke has no CUDA graph: every step at peak is eager, and the kinds account for all of them
        assert x["steps_at_peak_eager"] == x["steps_at_peak"] and x["steps_at_peak_replay"] == 0
        assert 0 < x["step_after_ms_mean_at_peak_eager"] <= x["step_ms_mean_at_peak_eager"]
        assert 0 <= x["step_build_ms_mean_at_peak_eager"] <= x["step_ms_mean_at_peak_eager"]
        assert x["engine"] == {"warm_steps": 1}
        # the wall's parts over every step: all eager here, and together no more than the wall
        assert x["steps_eager"] == x["steps"] and x["steps_replay"] == x["steps_capture"] == 0
        assert 0 < x["step_s_eager"] and x["step_s_eager"] + x["prefill_s_between_steps"] <= x["wall_s"]
        # every wall second in one named part of the engine's loop, the steps' part their sum
        # (a smoke run lasts ~0.2 s: the caller's few lines around the loop, and a collector pass there, can take a
        # few ms of it)
        parts = sum(v for k, v in x.items() if k.startswith("wall_s_"))
        assert parts == pytest.approx(x["wall_s"], rel=0.02, abs=0.01)
        assert x["wall_s_step"] == pytest.approx(x["step_s_eager"])
        place = [x[f"place_s_{p}"] for p in ("decide", "compact", "start", "first", "wait")]
        assert min(place) > 0 and sum(place) <= x["wall_s_place"]
        assert x["tokens_per_s_whole"] == pytest.approx(x["tokens_per_s"], rel=0.02)
        assert x["arrivals"] == "burst" and x["ttft_ms_p99"] >= x["ttft_ms_p50"] > 0
        assert x["itl_ms_p99"] >= x["itl_ms_p95"] == pytest.approx(x["p95_ms"])
    assert tput["full"]["max_concurrent"] == 2
    assert tput["full"]["room_waits"] > 0  # 6 requests, room for 2: a prefilled request waited for a leave
    assert min(tput[m]["max_concurrent"] for m in ("wnw", "adakv", "arkvale")) > 2
    assert tput["wnw"]["h2d_gb_per_s"] > 0 == tput["wnw_recall_off"]["h2d_gb_per_s"] == tput["adakv"]["h2d_gb_per_s"]
    assert {x["method"] for x in rows if x["kind"] == "latency_bs1"} == set(tput)


def test_serving_load_metrics_by_hand():
    """serving.py's steady window, TTFT and ITL on a hand-made timeline of three requests (arriving at 0, 1 and 3.5 s
    after the start at 100 s): the window runs from the end of the first step at peak concurrency (2 streams, 102.5)
    to the last admission (the third request's first token, 104.0); the ramp-up before it, the tail after."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks/serving.py"
    spec = importlib.util.spec_from_file_location("serving_bench", path)
    serving = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serving)
    st = BatchStats(started_at=100.0)
    st.emitted_at = {0: [100.5, 101.5, 102.0, 102.5, 103.0], 1: [102.0, 102.5, 103.0, 104.5], 2: [104.0, 104.5, 106.0]}
    st.first_token_at = {k: t[0] for k, t in st.emitted_at.items()}
    st.batch_sizes, st.step_at = [1, 2, 2, 1, 2, 1], [101.5, 102.5, 103.0, 104.0, 104.5, 106.0]
    st.wall_s = {"step": 5.0, "loop": 1.0}  # the run: 100.0 .. 106.0
    m = serving.load_metrics(st, {0: None, 1: None, 2: None}, [0.0, 1.0, 3.5])
    assert m["tokens_per_s_whole"] == pytest.approx(12 / 6.0) and m["requests_per_s_whole"] == pytest.approx(0.5)
    # TTFT: 0.5, 1.0, 0.5 s; ITL gaps (ms): 1000, 500, 500, 500 | 500, 500, 1500 | 500, 1500
    assert m["ttft_ms_p50"] == pytest.approx(500.0) and m["ttft_ms_p99"] == pytest.approx(990.0)
    assert m["itl_ms_p50"] == pytest.approx(500.0)
    # window: from the first step at peak (ends 102.5) to the last admission (104.0): tokens at 103.0 (x2), 104.0
    assert m["ramp_s"] == pytest.approx(2.5) and m["window_s"] == pytest.approx(1.5) and m["tail_s"] == pytest.approx(2.0)
    assert m["tokens_per_s_window"] == pytest.approx(3 / 1.5)
    assert m["requests_per_s_window"] == pytest.approx(1 / 1.5)  # request 0 finished at 103.0
    assert m["itl_ms_window_p50"] == pytest.approx(500.0)  # gaps ending in the window: 500 (103.0), 500 (103.0)
    assert serving.poisson_arrivals(3, 0.0) == [0.0, 0.0, 0.0]
    arr = serving.poisson_arrivals(4000, 4.0, seed=1)
    assert arr[0] == 0.0 and all(b >= a for a, b in zip(arr, arr[1:]))
    assert len(arr) / arr[-1] == pytest.approx(4.0, rel=0.05)


def test_the_benchmarks_scripted_signal_of_a_batch_equals_each_streams_own():
    """decode_speed.py's scripted anchor signal for a batch (`_adjust_signals`: a few launches for every stream)
    leaves each stream's accumulated signal and step counter exactly as its own `_adjust_signal` would, streams at
    different steps included; the prefill decision (step -1) is left alone."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks/decode_speed.py"
    spec = importlib.util.spec_from_file_location("decode_speed_bench", path)
    ds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ds)
    cls = ds.scripted_wnw_class(n_audio=50, steps=6, speed=2.0, beta=0.3)
    bumps = torch.rand(8, 50, generator=torch.Generator().manual_seed(0))

    def make(s0: int, seed: int, mass: float = 12.0):
        p = object.__new__(cls)
        p.scores_acc = torch.rand(50, generator=torch.Generator().manual_seed(seed))
        p._bumps, p._s, p._mass = bumps, torch.tensor([s0]), mass
        return p

    starts, masses = (0, 3, 5, 1), (12.0, 12.0, 7.0, 12.0)
    batch = [make(s, i, m) for i, (s, m) in enumerate(zip(starts, masses))]
    own = [make(s, i, m) for i, (s, m) in enumerate(zip(starts, masses))]
    steps = [4, 4, None, -1]  # None: inside a graph capture; -1: the prefill decision
    cls._adjust_signals(list(zip(batch, steps)))
    for p, i in zip(own, steps):
        p._adjust_signal(i)
    for a, b in zip(batch, own):
        torch.testing.assert_close(a.scores_acc, b.scores_acc, rtol=1e-6, atol=1e-7)
        assert int(a._s) == int(b._s)
    assert [int(p._s) for p in batch] == [1, 4, 6, 1]


def test_batch_parity_finds_the_parting_step_its_margin_and_the_drift_before_it():
    """benchmarks/batch_parity.py's comparison on hand-made results: the first differing token, the bs-1 margin
    there (top-1 minus top-2), the batched token's rank in the bs-1 logits, and the largest logit difference over
    the steps before; identical tokens give no parting step."""
    from types import SimpleNamespace

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("batch_parity", root / "benchmarks" / "batch_parity.py")
    bp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bp)
    lg = lambda *v: torch.tensor(v)  # noqa: E731
    alone = SimpleNamespace(tokens=[0, 1, 2], logits=[lg(3.0, 1.0, 0.0), lg(0.0, 2.0, 1.9), lg(0.0, 0.0, 5.0)])
    batched = SimpleNamespace(tokens=[0, 2, 2], logits=[lg(3.0, 1.25, 0.0), lg(0.0, 1.95, 1.97), lg(0.0, 0.0, 5.0)])
    row = bp.compare(alone, batched)
    assert row["part_at"] == 1 and not row["identical"] and row["steps"] == [3, 3]
    assert row["margin_at_part"] == pytest.approx(0.1) and row["rank_of_batched_token"] == 1
    assert row["max_drift_before"] == pytest.approx(0.25) and row["drift_at_part"] == pytest.approx(0.07, abs=1e-6)
    same = bp.compare(alone, alone)
    assert same["identical"] and same["part_at"] is None and same["max_drift_before"] == 0.0
