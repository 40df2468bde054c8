"""Prefill overlapped with decoding (`engine.decode.Stream(overlap=..., defer_place=...)`, `decode_batch`'s
`overlap_prefill`).

- deferring the methods' placement to the end of the forward pass (what an overlapped prefill does, so that its
  forward pass has no host read) makes exactly the decisions of placing each layer as it is computed (the
  reference): the same tiers for every head, the same first token, the same decoded results;
- on CUDA, a batch whose later requests are prefilled on their own CUDA stream while the first ones decode gives
  each request the tokens it gets alone, with the decode steps on the default stream or on one of the highest
  priority (`decode_priority`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from helpers import noise_audio, tiny_voxtral
from wnw_exp.engine.decode import Stream, decode_path
from wnw_exp.engine.serve import BatchStats, Request, decode_batch, generate
from wnw_exp.kv.pool import KVPool
from wnw_exp.methods import build_policy

SHIPPED = Path(__file__).resolve().parents[1] / "src/wnw_exp/calibration/shipped/tiny_random.json"
HAS_CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def _policy(method, bb):
    cfg = {"name": method, **({"head_scores": str(SHIPPED)} if method == "wnw" else {})}
    return build_policy(cfg, dict(bb.describe(), name="tiny_random"))


def _tiers(store) -> list:
    """Every head's placement, comparable across two stores of one kind."""
    if hasattr(store, "heads"):  # the reference store: positions on the device and on the host per head
        return [(t.gpu_pos.tolist(), t.cpu_pos.tolist(), torch.equal(t.gpu_k, t.gpu_k)) for layer in store.heads
                for t in layer]
    return [x.cpu().tolist() for x in (store.slot_of, store.on_host, store.audio_pos, store.n_resident,
                                       store.audio_len)]


@pytest.mark.parametrize("method", ["wnw", "adakv", "arkvale", "oracle"])
@pytest.mark.parametrize("store", ["reference", "packed"])
@torch.no_grad()
def test_placing_after_the_forward_pass_makes_the_same_decisions(method, store):
    bb = tiny_voxtral()
    prompt = bb.build_prompt(noise_audio(14.0, seed=3))
    if store == "packed" and not _policy(method, bb).packed_store:
        pytest.skip(f"{method} runs on the reference store")
    path = decode_path(bb.device, _policy(method, bb), store=store, fused=False, graph=False, kernels="torch")
    streams = []
    for defer, split in ((False, False), (True, False), (True, True)):
        st = Stream(bb, prompt, _policy(method, bb), retention=0.2, max_new_tokens=8, path=path, defer_place=defer)
        if split:  # the decisions in one call (one turn of decode_batch's loop), the rest of the placement in the next
            for _ in st.prefill_layers():
                pass
            st.decide()
            assert st.decided
            st.finish_prefill()
        else:
            st.prefill()
        streams.append(st)
    now = streams[0]
    for later in streams[1:]:
        assert later.defer_place and not now.defer_place
        assert _tiers(later.store) == _tiers(now.store)
        assert later.next_token == now.next_token and torch.equal(later.logits, now.logits)
        assert later.policy.knobs() == now.policy.knobs()
        assert later.store.n_gpu() < later.store.n_full  # the method really placed something


@pytest.mark.skipif(not HAS_CUDA, reason="an overlapped prefill runs on a CUDA stream of its own")
@pytest.mark.parametrize("method", ["full", "wnw", "adakv"])
@pytest.mark.parametrize("priority", [False, True])
def test_a_prefill_overlapped_with_decoding_gives_each_request_its_bs1_tokens(method, priority):
    """And with the loop's work on a stream of the highest priority (`decode_priority`): the same tokens."""
    bb = tiny_voxtral()
    bb.model.to(torch.device("cuda"), torch.float32)
    bb.eos_token_ids = [-1]
    r = 0.2 if method != "full" else 1.0
    prompts = [bb.build_prompt(noise_audio(s, seed=i)) for i, s in enumerate((14.0, 8.0, 11.0, 9.0))]
    caps = (12, 5, 7, 6)
    pool = KVPool(100_000, bb.head_dim, bb.dtype, bb.device)
    path = dict(store="packed", fused=True, kernels="triton")
    solo = [generate(bb, p, _policy(method, bb), retention=r, max_new_tokens=c, **path).tokens
            for p, c in zip(prompts, caps)]
    stats = BatchStats()
    got = dict(decode_batch(bb, [Request(i, p, c) for i, (p, c) in enumerate(zip(prompts, caps))],
                            _policy(method, bb).fork, retention=r, pool=pool, stats=stats, overlap_prefill=True,
                            prefill_chunk_layers=1, max_concurrent=2, decode_priority=priority, **path))
    assert [got[i].tokens for i in range(len(prompts))] == solo
    assert max(stats.batch_sizes) > 1 and pool.used_blocks == 0


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs")
def test_a_composition_of_a_warm_bucket_replays_at_its_first_step_and_changes_nothing():
    bb = tiny_voxtral()
    bb.model.to(torch.device("cuda"), torch.float32)
    bb.eos_token_ids = [-1]
    prompts = [bb.build_prompt(noise_audio(10.0, seed=i)) for i in range(4)]
    caps = (9, 5, 8, 6)  # two at a time: (0, 1), then 1 leaves and 2 joins, ...: compositions of two again
    path = dict(store="packed", fused=True, kernels="triton")
    solo = [generate(bb, p, _policy("wnw", bb), retention=0.2, max_new_tokens=c, **path).tokens
            for p, c in zip(prompts, caps)]
    stats = BatchStats()
    pool = KVPool(100_000, bb.head_dim, bb.dtype, bb.device)
    got = dict(decode_batch(bb, [Request(i, p, c) for i, (p, c) in enumerate(zip(prompts, caps))],
                            _policy("wnw", bb).fork, retention=0.2, pool=pool, stats=stats, max_concurrent=2,
                            overlap_prefill=False, **path))
    assert [got[i].tokens for i in range(4)] == solo
    starts = [j for j in range(len(stats.batch_sizes)) if j == 0 or stats.step_build_ms[j] > 0]  # new compositions
    firsts = [(stats.batch_sizes[j], stats.step_kinds[j]) for j in starts]
    assert firsts[0] == (1, "eager")  # nothing warm yet
    assert (2, "eager") in firsts  # the first pair warms its bucket up
    captured = [b for b, kind in zip(stats.batch_sizes, stats.step_kinds) if kind == "capture"]
    assert sorted(captured) == sorted(set(captured))  # one capture a bucket, whatever joins and leaves
    assert firsts.count((2, "replay")) >= 1  # a later pair replays its bucket's graph at its first step


@pytest.mark.parametrize("store_kind", ["reference", "packed"])
@torch.no_grad()
def test_placements_of_consecutive_layers_in_one_call_set_what_one_call_a_layer_sets(store_kind):
    """`methods.base.apply_placements`: runs of consecutive layers in one `set_tiers_block` call, layers without a
    host tier or a head selection among them, a gap between runs, against `Placement.apply` layer by layer."""
    from wnw_exp.kv.packed import PackedAudioKVStore
    from wnw_exp.kv.reference import AudioKVStore
    from wnw_exp.methods.base import Placement, apply_placements

    L, H, D, N = 5, 2, 4, 24
    g = torch.Generator().manual_seed(0)

    def make():
        cls = PackedAudioKVStore if store_kind == "packed" else AudioKVStore
        kw = dict(kernels="torch") if store_kind == "packed" else {}
        st = cls(L, H, D, N, torch.device("cpu"), torch.float32, 4, **kw)
        gk = torch.Generator().manual_seed(1)
        for li in range(L):
            k, v = torch.randn(H, N + 3, D, generator=gk), torch.randn(H, N + 3, D, generator=gk)
            st.write_prefill(li, k, v, (1, N + 1))
        return st

    placements = []
    for li in (0, 1, 2, 4):  # layer 3 keeps everything: two runs
        gpu = torch.rand(H, N, generator=g) < 0.4
        cpu = (~gpu & (torch.rand(H, N, generator=g) < 0.5)) if li != 1 else None
        select = torch.tensor([True, li != 2])
        placements.append((li, Placement(gpu, cpu, select if li in (2, 4) else None)))
    one, each = make(), make()
    apply_placements(one, placements)
    for li, p in placements:
        p.apply(each, li)
    assert _tiers(one) == _tiers(each)
    if store_kind == "packed":
        assert torch.equal(one.audio_k, each.audio_k) and torch.equal(one.audio_v, each.audio_v)
