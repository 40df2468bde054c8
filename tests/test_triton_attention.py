"""The Triton decode-attention kernel matches the CPU reference `AudioKVStore.attend`.

Runs on CUDA when present; otherwise in Triton's interpreter (TRITON_INTERPRET=1, CPU tensors) when
triton is installed; skips cleanly when it is not (triton is the optional `gpu` extra).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from wnw_exp.kv.reference import AudioKVStore

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
if not HAS_TRITON:
    pytest.skip("triton is not installed (optional `gpu` extra)", allow_module_level=True)
if not HAS_CUDA:
    # The interpreter must be chosen before triton is imported by the kernel module.
    if "triton" in __import__("sys").modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported without TRITON_INTERPRET=1 and there is no CUDA", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"

from wnw_exp.kv.triton_attention import ObserverSum, decode_attention  # noqa: E402

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


def _flat(store: AudioKVStore, layer: int, slack: int = 3):
    """Pack the store's per-head GPU tiers of `layer` into the flat layout, with spare rows between heads."""
    heads = store.heads[layer]
    cap = max(len(t.gpu_pos) for t in heads) + slack
    H, D = store.n_kv_heads, store.head_dim
    ak = torch.randn(H * cap, D, device=DEVICE).to(store.dtype) * 100  # garbage outside the valid rows
    av = torch.randn_like(ak) * 100
    apos = torch.zeros(H * cap, dtype=torch.int32, device=DEVICE)
    off = torch.arange(H, dtype=torch.int32, device=DEVICE) * cap
    lens = torch.tensor([len(t.gpu_pos) for t in heads], dtype=torch.int32, device=DEVICE)
    for h, t in enumerate(heads):
        perm = torch.randperm(len(t.gpu_pos))  # row order inside a head must not matter
        n = len(t.gpu_pos)
        ak[h * cap: h * cap + n] = t.gpu_k[perm].to(DEVICE)
        av[h * cap: h * cap + n] = t.gpu_v[perm].to(DEVICE)
        apos[h * cap: h * cap + n] = t.gpu_pos[perm].to(DEVICE, torch.int32)
    return ak, av, apos, off, lens, cap


@pytest.mark.parametrize("n_q,n_kv,n_audio,keep_frac,dtype,head_dim", [
    (8, 2, 150, 0.3, torch.float32, None),
    (32, 8, 97, 1.0, torch.float32, None),
    (4, 4, 40, 0.0, torch.float32, None),  # no audio resident at all
    (8, 2, 150, 0.3, torch.float32, 8),  # below K 16: the tiles multiply without tl.dot ("fma")
    pytest.param(16, 2, 300, 0.2, torch.bfloat16, None, marks=pytest.mark.skipif(not HAS_CUDA, reason="bf16 on CUDA")),
    pytest.param(32, 8, 3000, 0.2, torch.bfloat16, None, marks=pytest.mark.skipif(not HAS_CUDA, reason="large on CUDA")),
])
def test_matches_reference(n_q, n_kv, n_audio, keep_frac, dtype, head_dim):
    torch.manual_seed(0)
    D, pre, post = head_dim or (64 if not HAS_CUDA else 128), 5, 7
    T = pre + n_audio + post
    store = AudioKVStore(1, n_kv, D, n_audio, torch.device("cpu"), dtype, dense_capacity=4)
    k = torch.randn(n_kv, T, D).to(dtype)
    v = torch.randn(n_kv, T, D).to(dtype)
    store.write_prefill(0, k, v, (pre, pre + n_audio))
    for h in range(n_kv):  # a different resident subset per head, some with host copies
        perm = torch.randperm(n_audio)
        n_keep = int(round(keep_frac * n_audio)) if h else max(int(round(keep_frac * n_audio)) - 3, 0)
        store.set_tiers(0, h, perm[:n_keep], perm[n_keep: n_keep + 5])
    ak, av, apos, off, lens, cap = _flat(store, 0)
    dk = store.dense_k[0].clone()
    dv = store.dense_v[0].clone()
    n_dense = store.dense_len[0]
    q = torch.randn(n_q, D).to(dtype)
    kn, vn = torch.randn(n_kv, D).to(dtype), torch.randn(n_kv, D).to(dtype)
    observe = [0, n_q - 1, n_q // 2]
    scale = D ** -0.5
    ref_out, ref_probs = store.attend(0, q, kn, vn, scale, observe)

    dk[:, n_dense], dv[:, n_dense] = kn, vn
    dense_len = torch.tensor([n_dense + 1], dtype=torch.int32, device=DEVICE)
    probs = torch.full((len(observe), n_audio), 7.0, device=DEVICE)
    scratch: dict = {}
    out = decode_attention(q.to(DEVICE), dk.to(DEVICE), dv.to(DEVICE), dense_len, ak, av, off, lens, scale,
                           max_audio_per_head=cap, audio_pos=apos,
                           observe=torch.tensor(observe, dtype=torch.int32, device=DEVICE), probs_out=probs,
                           scratch=scratch)
    # the observers' weights summed over the heads in one launch, each key found through slot_of (position ->
    # slot within its head's rows), added to what the accumulator held: the reference's weights, summed
    slot_of = torch.full((n_kv, n_audio), -1, dtype=torch.int32, device=DEVICE)
    for h in range(n_kv):
        n = int(lens[h])
        slot_of[h, apos[h * cap: h * cap + n].long()] = torch.arange(n, dtype=torch.int32, device=DEVICE)
    acc = torch.full((n_audio,), 0.5, device=DEVICE)
    ObserverSum([(0, acc, slot_of, observe)], DEVICE)(q.to(DEVICE), ak, off, scratch["lse"], scale)
    # fp32 tiles multiply in IEEE fp32 (dot_precision), on CUDA too
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-3 if HAS_CUDA else 1e-4
    torch.testing.assert_close(out.float().cpu(), ref_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(probs.cpu(), ref_probs.float(), atol=tol / 10, rtol=tol)
    torch.testing.assert_close(acc.cpu(), 0.5 + ref_probs.float().sum(0), atol=tol / 10, rtol=tol)
    # A full softmax row sums to one over dense + audio; the audio share is what the reference reports.
    assert torch.all(probs.sum(-1) <= 1 + 1e-4)


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need CUDA")
def test_graph_capture_follows_device_lengths():
    """Captured once, the kernel sees lengths changed in place on the device (no host sync, fixed grid)."""
    torch.manual_seed(1)
    H, G, D, cap, Cd = 8, 4, 128, 512, 64
    dk = torch.randn(H, Cd, D, device="cuda", dtype=torch.bfloat16)
    dv = torch.randn_like(dk)
    ak = torch.randn(H * cap, D, device="cuda", dtype=torch.bfloat16)
    av = torch.randn_like(ak)
    off = torch.arange(H, dtype=torch.int32, device="cuda") * cap
    lens = torch.full((H,), 100, dtype=torch.int32, device="cuda")
    dlen = torch.tensor([10], dtype=torch.int32, device="cuda")
    q = torch.randn(H * G, D, device="cuda", dtype=torch.bfloat16)
    scratch: dict = {}

    def run():
        return decode_attention(q, dk, dv, dlen, ak, av, off, lens, D ** -0.5, max_audio_per_head=cap,
                                scratch=scratch)

    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run()
    for n_a, n_d in [(100, 10), (300, 20), (512, 64), (0, 1)]:
        lens.fill_(n_a)
        dlen.fill_(n_d)
        g.replay()
        ref = run()
        torch.testing.assert_close(out, ref, atol=0, rtol=0)
        kk = torch.cat([dk[:, :n_d], ak.view(H, cap, D)[:, :n_a]], 1).float().repeat_interleave(G, 0)
        vv = torch.cat([dv[:, :n_d], av.view(H, cap, D)[:, :n_a]], 1).float().repeat_interleave(G, 0)
        w = torch.softmax(torch.einsum("hd,hnd->hn", q.float(), kk) * D ** -0.5, -1)
        torch.testing.assert_close(out.float(), torch.einsum("hn,hnd->hd", w, vv), atol=2e-2, rtol=2e-2)


def test_packed_store_matches_reference_through_moves():
    """PackedAudioKVStore (kernel, packed buffers, queued recall/release) = AudioKVStore, step by step."""
    from wnw_exp.kv.packed import PackedAudioKVStore

    torch.manual_seed(2)
    L, H, G, D, n_audio, pre, post = 2, 2, 4, 64, 120, 4, 6
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    T = pre + n_audio + post
    ref = AudioKVStore(L, H, D, n_audio, torch.device("cpu"), dtype, dense_capacity=8)
    fast = PackedAudioKVStore(L, H, D, n_audio, DEVICE, dtype, dense_capacity=8, kernels="triton")
    for li in range(L):
        k, v = torch.randn(H, T, D).to(dtype), torch.randn(H, T, D).to(dtype)
        ref.write_prefill(li, k, v, (pre, pre + n_audio))
        fast.write_prefill(li, k.to(DEVICE), v.to(DEVICE), (pre, pre + n_audio))
        for h in range(H):
            perm = torch.randperm(n_audio)
            gpu, cpu = perm[:20 + 5 * h], perm[20 + 5 * h: 80]
            ref.set_tiers(li, h, gpu, cpu)
            fast.set_tiers(li, h, gpu, cpu)
    fast.compact(headroom=16)
    assert fast.caps.tolist() == [20 + 16, 25 + 16] * L  # each head: its resident rows + headroom
    scale = D ** -0.5
    for step in range(4):
        for li in range(L):
            for h in range(H):
                host = ref.heads[li][h].cpu_pos
                on = ref.heads[li][h].gpu_pos.cpu()
                rec = host[~torch.isin(host, on)][step * 3: step * 3 + 6]
                rel = on[torch.isin(on, host)][:4]
                ref.recall(li * H + h, rec)
                ref.release(li * H + h, rel)
                fast.recall(li * H + h, rec)
                fast.release(li * H + h, rel)
        for li in range(L):
            q = torch.randn(H * G, D).to(dtype)
            kn, vn = torch.randn(H, D).to(dtype), torch.randn(H, D).to(dtype)
            o_ref, p_ref = ref.attend(li, q, kn, vn, scale, [1, 6])
            o, p = fast.attend(li, q.to(DEVICE), kn.to(DEVICE), vn.to(DEVICE), scale, [1, 6])
            tol = 2e-2 if dtype == torch.bfloat16 else 5e-3 if HAS_CUDA else 1e-4
            torch.testing.assert_close(o.float().cpu(), o_ref.float(), atol=tol, rtol=tol)
            torch.testing.assert_close(p.cpu(), p_ref.float(), atol=tol / 10, rtol=tol)
        assert ref.end_step() == fast.end_step()
    assert fast.audio_bytes_on_device() < L * H * n_audio * D * 2 * torch.finfo(dtype).bits // 8


def test_packed_store_sizes_each_head_on_its_own():
    """A head that keeps all its audio (a WnW anchor) must not make every other head hold as much."""
    from wnw_exp.kv.packed import PackedAudioKVStore

    L, H, D, n_audio = 2, 4, 16, 200
    fast = PackedAudioKVStore(L, H, D, n_audio, DEVICE, torch.float32, dense_capacity=4, kernels="triton")
    for li in range(L):
        fast.write_prefill(li, torch.randn(H, n_audio + 2, D).to(DEVICE), torch.randn(H, n_audio + 2, D).to(DEVICE),
                           (1, n_audio + 1))
        fast.set_tiers(li, 0, torch.arange(n_audio))  # anchor: everything, no host tier
        fast.set_tiers(li, 1, torch.arange(0, n_audio, 10), torch.arange(5, n_audio, 10))  # tidal
        for h in (2, 3):
            fast.set_tiers(li, h, torch.arange(0, n_audio, 10))  # fixed: 10%, the rest dropped
    fast.compact(headroom=30)
    assert fast.caps.tolist() == [200, 20 + 30, 20, 20] * L
    full = L * H * n_audio * D * 4 * 2
    held = sum(fast.caps) * (D * 4 * 2 + 4) + L * H * 4  # K, V, positions (int32), lengths
    assert fast.audio_bytes_on_device() == held < 0.38 * full  # (200 + 50 + 20 + 20) / 800 = 0.36 of K, V


@pytest.mark.parametrize("method", ["full", "adakv", "arkvale", "wnw", "oracle"])
def test_engine_on_the_packed_store_matches_the_reference_store(method):
    """The whole decode loop with each method's real hooks: the fast store gives the reference's tokens."""
    from pathlib import Path

    from helpers import noise_audio, tiny_voxtral
    from wnw_exp.engine.serve import generate
    from wnw_exp.methods import build_policy

    backbone = tiny_voxtral()
    backbone.model.to(DEVICE)
    backbone.eos_token_ids = [-1]
    info = dict(backbone.describe(), name="tiny_random")  # same head layout as the shipped tiny_random scores
    cfg = {"name": method}
    if method == "wnw":
        cfg["head_scores"] = str(Path(__file__).resolve().parents[1] / "src/wnw_exp/calibration/shipped/tiny_random.json")
    prompt = backbone.build_prompt(noise_audio(20.0))
    runs = {}
    for store in ("reference", "packed"):
        policy = build_policy(cfg, info)
        runs[store] = generate(backbone, prompt, policy, retention=0.2 if method != "full" else 1.0,
                               max_new_tokens=10, keep_logits=True, store=store)
    ref, fast = runs["reference"], runs["packed"]
    assert fast.tokens == ref.tokens
    for a, b in zip(fast.logits, ref.logits):
        assert (a - b).abs().max() < 1e-3
    for key in ("r_gpu", "r_gpu_cpu", "mb_per_step"):
        assert fast.store_summary[key] == pytest.approx(ref.store_summary[key], rel=1e-6, abs=1e-9)
    # the fast store's memory shrinks with retention, heads sized on their own (not the oracle's: by design each of
    # its heads keeps room for all its audio, since any position may be its top-r at the next step)
    if method not in ("full", "oracle"):
        full_kv = backbone.n_layers * backbone.n_kv_heads * prompt.n_audio * backbone.head_dim * 4 * 2
        assert fast.store_summary["audio_bytes_on_device"] < 0.6 * full_kv


def test_split_k_caps_a_programs_walk_and_keeps_single_stream_shapes():
    """n_splits_for: a single stream's shapes (8 KV heads, up to 16,000 keys) keep the split count of the formula
    without a cap; a batch of many (stream, head) pairs gets enough programs that none walks more than
    MAX_TILES_PER_PROGRAM tiles of the longest head (one program a pair had made a layer wait for its longest)."""
    import triton

    from wnw_exp.kv.triton_attention import BLOCK_N, MAX_TILES_PER_PROGRAM, n_splits_for

    def uncapped(max_keys, n_heads, target=264):
        tiles_total = max(1, triton.cdiv(max_keys, BLOCK_N))
        tiles = max(1, triton.cdiv(tiles_total, max(1, target // n_heads)))
        return triton.cdiv(tiles_total, tiles)

    for keys in range(1, 16_000, 37):
        assert n_splits_for(keys, 8) == uncapped(keys, 8)
    for n_heads, keys in ((264, 3_300), (96, 3_300), (112, 7_800), (264, 64), (600, 12_000)):
        n = n_splits_for(keys, n_heads)
        tiles_total = triton.cdiv(keys, BLOCK_N)
        assert triton.cdiv(tiles_total, n) <= MAX_TILES_PER_PROGRAM  # the longest head's walk per program
        assert (n - 1) * triton.cdiv(tiles_total, n) < tiles_total  # no program without a tile of it
    assert n_splits_for(3_300, 264) == 7 and uncapped(3_300, 264) == 1
