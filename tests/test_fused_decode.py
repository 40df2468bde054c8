"""The fused decode step (engine/step.py), its kernels, and the decode benchmark (benchmarks/decode_speed.py).

- the fused step (its kernels' PyTorch equivalents) gives the reference step's tokens, logits, accounting and
  method decisions, on both backbone families (tests/test_engine.py checks both against transformers' generate());
- each Triton kernel of the step, the packed store's flush (of one store, or of several together), and the whole
  fused step in Triton match their PyTorch equivalents: on CUDA, else in Triton's interpreter; skipped cleanly
  without triton;
- the packed store's PyTorch attention matches the reference store, free slots skipped;
- `decode_speed.py --smoke` runs every row at tiny dims on the CPU, importing nothing that the GPU machine lacks
  (hydra, omegaconf, soxr, soundfile, espeak, jiwer);
- on CUDA: the CUDA-graph path gives the eager fused path's tokens (bf16 logits compared while inputs agree).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import noise_audio, tiny_qwen_omni, tiny_voxtral

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON and not HAS_CUDA and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything (transformers too) imports triton
SHIPPED = ROOT / "src/wnw_exp/calibration/shipped/tiny_random.json"


def _triton_env():
    if not HAS_TRITON:
        pytest.skip("triton is not installed (optional `gpu` extra)")
    if not HAS_CUDA:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("triton was imported without TRITON_INTERPRET=1 and there is no CUDA")
        os.environ["TRITON_INTERPRET"] = "1"
    return torch.device("cuda" if HAS_CUDA else "cpu")


def _policy(method: str, backbone):
    from wnw_exp.methods import build_policy

    cfg = {"name": method, **({"head_scores": str(SHIPPED)} if method == "wnw" else {})}
    return build_policy(cfg, dict(backbone.describe(), name="tiny_random"))  # tiny_random's head layout


def _runs(backbone, prompt, method, paths: dict, n_new=10):
    out = {}
    for name, path in paths.items():
        policy = _policy(method, backbone)
        out[name] = (_generate(backbone, prompt, policy, n_new, **path), policy)
    return out


def _generate(backbone, prompt, policy, n_new, **path):
    from wnw_exp.engine.serve import generate

    return generate(backbone, prompt, policy, retention=0.2 if policy.name != "full" else 1.0, max_new_tokens=n_new,
                    keep_logits=True, **path)


def _same_run(a, b, tol):
    (ra, pa), (rb, pb) = a, b
    assert ra.tokens == rb.tokens
    for x, y in zip(ra.logits, rb.logits):
        assert (x - y).abs().max() < tol
    for key in ("r_gpu", "r_gpu_cpu", "mb_per_step"):
        assert ra.store_summary[key] == pytest.approx(rb.store_summary[key], rel=1e-6, abs=1e-9)
    assert ra.trace == rb.trace  # the method's decisions (WnW's chunks and segments), step by step
    assert pa.knobs() == pb.knobs()


REFERENCE = dict(store="reference")  # the reference step on the reference store: what the CPU runs
FUSED_TORCH = dict(store="packed", fused=True, kernels="torch")


@pytest.mark.parametrize("case", ["voxtral-full", "voxtral-wnw", "voxtral-arkvale", "qwen_omni-full", "qwen_omni-arkvale"])
def test_fused_step_matches_the_reference_step(case):
    family, method = case.split("-")
    backbone = (tiny_voxtral if family == "voxtral" else tiny_qwen_omni)()
    backbone.eos_token_ids = [-1]
    prompt = backbone.build_prompt(noise_audio(20.0))
    runs = _runs(backbone, prompt, method, dict(reference=REFERENCE, fused=FUSED_TORCH))
    _same_run(runs["fused"], runs["reference"], 1e-4)
    if method != "full":
        assert runs["fused"][0].store_summary["mb_per_step"] > 0  # the method really moved KV
    # the HF modules still work on the fused weights (views into the concatenated tensors)
    attn = backbone.layers[0].self_attn
    assert attn.k_proj.weight.data_ptr() == attn.q_proj.weight.data_ptr() + attn.q_proj.weight.numel() * 4
    assert backbone.fused_layers()[0].w_qkv.data_ptr() == attn.q_proj.weight.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not HAS_CUDA, reason="bf16 kernels on CUDA"))])
def test_triton_step_kernels_match_torch(dtype):
    dev = _triton_env()
    from wnw_exp.engine import step as fz
    from wnw_exp.engine import triton_ops as tr

    torch.manual_seed(0)
    n_q, n_kv, D, hid, inter, P = 8, 2, 64 if not HAS_CUDA else 128, 3072 if HAS_CUDA else 200, 700, 40
    # add + RMSNorm
    w = torch.randn(hid, device=dev).to(dtype)
    outs = []
    for impl in (fz.add_rmsnorm_torch, tr.add_rmsnorm):
        h = torch.randn(hid, generator=torch.Generator().manual_seed(1)).to(dev, dtype)
        d = torch.randn(hid, generator=torch.Generator().manual_seed(2)).to(dev, dtype)
        o = torch.empty(hid, device=dev, dtype=dtype)
        impl(h, d, w, 1e-5, o)
        outs.append((h, o.clone()))
        impl(h, None, w, 1e-5, o)
        outs.append((h, o))
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    for a, b in zip(outs[:2], outs[2:]):
        torch.testing.assert_close(b[0], a[0], atol=0, rtol=0)  # the residual add rounds the same
        torch.testing.assert_close(b[1], a[1], **tol)
    # RoPE + KV append at a device position and length
    qkv = torch.randn((n_q + 2 * n_kv) * D, device=dev).to(dtype)
    cos, sin = torch.randn(P, D, device=dev).to(dtype), torch.randn(P, D, device=dev).to(dtype)
    pos, dlen = torch.tensor([17], device=dev), torch.tensor([5], device=dev)
    res = []
    for impl in (fz.rope_append_torch, tr.rope_append):
        q = torch.empty(n_q, D, device=dev, dtype=dtype)
        dk, dv = torch.zeros(n_kv, 9, D, device=dev, dtype=dtype), torch.zeros(n_kv, 9, D, device=dev, dtype=dtype)
        impl(qkv, cos, sin, pos, dlen, q, dk, dv, n_q, n_kv, D)
        res.append((q, dk, dv))
    for a, b in zip(*res):
        torch.testing.assert_close(b, a, **tol)
    assert res[1][1][:, 5].abs().sum() > 0 and res[1][1][:, [4, 6]].abs().sum() == 0  # written at dlen only
    # the prefill's RoPE and head split over a prompt of T rows: one row, a block and a part, several blocks
    for T in (1, 21, 40):
        qkv_t = torch.randn(T, (n_q + 2 * n_kv) * D, device=dev).to(dtype)
        split = []
        for impl in (fz.rope_split_torch, tr.rope_split):
            qs, ks, vs = (torch.full((h, T, D), 7.0, device=dev, dtype=dtype) for h in (n_q, n_kv, n_kv))
            impl(qkv_t, cos[:T].contiguous(), sin[:T].contiguous(), qs, ks, vs, n_q, n_kv, D)
            split.append((qs, ks, vs))
        for a, b in zip(*split):
            torch.testing.assert_close(b, a, **tol)
        torch.testing.assert_close(split[1][2], qkv_t.view(T, -1, D)[:, n_q + n_kv:].transpose(0, 1), atol=0, rtol=0)
    # SiLU * up
    gu = torch.randn(2 * inter, device=dev).to(dtype)
    a, b = torch.empty(inter, device=dev, dtype=dtype), torch.empty(inter, device=dev, dtype=dtype)
    torch.testing.assert_close(tr.silu_mul(gu, b), fz.silu_mul_torch(gu, a), **tol)


@pytest.mark.parametrize("free_slots", [False, True])
def test_torch_attention_matches_the_kernel_and_the_reference_store(free_slots):
    """`attention_torch` (the packed store's attention without Triton) = the reference store; free slots (position
    -1, garbage keys) inside a head's scanned rows are skipped."""
    from wnw_exp.kv.packed import attention_torch
    from wnw_exp.kv.reference import AudioKVStore

    torch.manual_seed(3)
    n_q, n_kv, D, n_audio, pre, post = 8, 2, 32, 90, 4, 6
    T = pre + n_audio + post
    store = AudioKVStore(1, n_kv, D, n_audio, torch.device("cpu"), torch.float32, dense_capacity=4)
    k, v = torch.randn(n_kv, T, D), torch.randn(n_kv, T, D)
    store.write_prefill(0, k, v, (pre, pre + n_audio))
    for h in range(n_kv):
        perm = torch.randperm(n_audio)
        store.set_tiers(0, h, perm[: 20 + 15 * h], perm[40:50])
    cap = 80
    ak, av = torch.randn(n_kv * cap, D) * 50, torch.randn(n_kv * cap, D) * 50  # garbage past the lengths
    apos = torch.full((n_kv * cap,), -1, dtype=torch.int32)
    lens = []
    for h, t in enumerate(store.heads[0]):
        n = len(t.gpu_pos)
        slots = torch.arange(n) * (2 if free_slots else 1)  # every other slot free
        ak[h * cap + slots], av[h * cap + slots], apos[h * cap + slots] = t.gpu_k, t.gpu_v, t.gpu_pos.int()
        lens.append(int(slots[-1]) + 1)
    off = torch.arange(n_kv, dtype=torch.int32) * cap
    lens = torch.tensor(lens, dtype=torch.int32)
    dk, dv, n_d = store.dense_k[0].clone(), store.dense_v[0].clone(), store.dense_len[0]
    q, kn, vn = torch.randn(n_q, D), torch.randn(n_kv, D), torch.randn(n_kv, D)
    observe = [0, 5, 7]
    ref_out, ref_probs = store.attend(0, q, kn, vn, D ** -0.5, observe)
    dk[:, n_d], dv[:, n_d] = kn, vn
    probs = torch.full((3, n_audio), 9.0)
    out = attention_torch(q, dk, dv, torch.tensor([n_d + 1]), ak, av, off, lens, D ** -0.5,
                          max_audio_per_head=cap, audio_pos=apos, observe=torch.tensor(observe, dtype=torch.int32),
                          probs_out=probs)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(probs, ref_probs, atol=1e-6, rtol=1e-5)


def test_triton_queueing_inside_a_capture_marks_what_the_torch_queueing_marks(monkeypatch):
    """Inside a graph capture the packed store queues recalls and releases without host reads; with Triton kernels
    in one launch each (kv/triton_moves.py: queue_pairs). Both ways, with and without `select`, on heads with and
    without host copies, mark the same positions (the capture is simulated: the CPU has none)."""
    dev = _triton_env()
    import wnw_exp.kv.packed as packed

    monkeypatch.setattr(packed, "_capturing", lambda: True)
    L, H, D, n_audio, pre = 2, 3, 8, 50, 2
    stores = {}
    for kernels in ("torch", "triton"):
        st = packed.PackedAudioKVStore(L, H, D, n_audio, dev, torch.float32, dense_capacity=4, kernels=kernels)
        gen = torch.Generator().manual_seed(3)
        for li in range(L):
            k = torch.randn(H, n_audio + pre + 1, D, generator=gen).to(dev)
            st.write_prefill(li, k, k, (pre, pre + n_audio))
            for h in range(H):
                perm = torch.randperm(n_audio, generator=gen)
                st.set_tiers(li, h, perm[:12], perm[8:40])
        st.compact(headroom=np.full(L * H, 40))
        stores[kernels] = st
    gen = torch.Generator().manual_seed(4)
    rows = torch.randint(0, L * H, (300,), generator=gen)
    pos = torch.randint(0, n_audio, (300,), generator=gen)
    flat = torch.unique(rows * n_audio + pos)  # distinct pairs
    rows, pos = (flat // n_audio).to(dev), (flat % n_audio).to(dev)
    sel = (torch.rand(len(flat), generator=gen) < 0.5).to(dev)
    # what each store must queue (no host read inside a capture: nothing is counted or checked, only marked): the
    # pairs asked for that are not resident (recall) or resident (release), and have a host copy
    asked_recall = torch.zeros(L * H, n_audio, dtype=torch.bool, device=dev)
    asked_release = torch.zeros_like(asked_recall)
    asked_recall[rows[sel], pos[sel]] = True
    asked_recall[rows[:40], pos[:40]] = True
    asked_release[rows[~sel], pos[~sel]] = True
    asked_release[rows[-40:], pos[-40:]] = True
    for st in stores.values():
        resident, on_host = st.slot_of >= 0, st.on_host.clone()
        st.recall(rows, pos, select=sel)
        st.release(rows, pos, select=~sel)
        st.recall(rows[:40], pos[:40])
        st.release(rows[-40:], pos[-40:])
        assert torch.equal(st.queued_recall, asked_recall & ~resident & on_host)
        assert torch.equal(st.queued_release, asked_release & resident & on_host)
    a, b = stores["torch"], stores["triton"]
    assert torch.equal(a.queued_recall, b.queued_recall) and torch.equal(a.queued_release, b.queued_release)
    assert a.queued_recall.any() and a.queued_release.any()
    # chosen per segment (WnW's chunk swap): one launch marks what recall/release with the gathered masks mark
    seg = (pos // 5).contiguous()
    rec_m = (torch.rand(10, generator=gen) < 0.5).to(dev)
    rel_m = (torch.rand(10, generator=gen) < 0.5).to(dev)
    for st in stores.values():
        st.queued_recall.zero_()
        st.queued_release.zero_()
    b.queue_segments(rows, pos, seg, rec_m, rel_m)  # Triton: one launch
    a.recall(rows, pos, select=rec_m[seg])  # the torch store: the two calls with the gathered masks
    a.release(rows, pos, select=rel_m[seg])
    assert torch.equal(a.queued_recall, b.queued_recall) and torch.equal(a.queued_release, b.queued_release)
    assert a.queued_recall.any() and a.queued_release.any()
    # outside a capture the Triton store takes the same launch (no host read: a decision at prefill or in an
    # eager step does not wait for the device), marking the same
    monkeypatch.setattr(packed, "_capturing", lambda: False)
    b.queued_recall.zero_()
    b.queued_release.zero_()
    b.queue_segments(rows, pos, seg, rec_m, rel_m)
    assert torch.equal(a.queued_recall, b.queued_recall) and torch.equal(a.queued_release, b.queued_release)


L_F, H_F, D_F, PRE_F = 2, 3, 16, 2  # the flush tests' stores: layers, KV heads, head dim, text rows before the audio


def _flush_store(kernels: str, n_audio: int, seed: int, dev, mirrored: bool = True, dtype=torch.float32,
                 host_mirror=True):
    """A packed store whose heads each hold part of the audio on the device and part on the host only (one head,
    row 2, and with `mirrored=False` every head, without a host tier: it never moves), the last head with too little
    recall room (its recalls overflow)."""
    from wnw_exp.kv.packed import PackedAudioKVStore

    st = PackedAudioKVStore(L_F, H_F, D_F, n_audio, dev, dtype, dense_capacity=8, kernels=kernels,
                            host_mirror=host_mirror)
    gen = torch.Generator().manual_seed(seed)
    a, b, c = n_audio // 5, n_audio // 7, n_audio * 6 // 7
    for li in range(L_F):
        k = torch.randn(H_F, n_audio + PRE_F + 1, D_F, generator=gen).to(dev, dtype)
        st.write_prefill(li, k, k * 2, (PRE_F, PRE_F + n_audio))
        for h in range(H_F):
            perm = torch.randperm(n_audio, generator=gen)
            if (h == 2 and li == 0) or not mirrored:
                st.set_tiers(li, h, perm[:a])  # no host tier: never moves
            else:
                st.set_tiers(li, h, perm[:a], perm[b:c])  # a mirrored overlap and a host-only part
    st.compact(headroom=np.array([45] * (L_F * H_F - 1) + [2]))  # the last head: too little room
    return st


def _queue_random(st, step: int, dev) -> None:
    """Random recalls and releases on the heads with a host tier (some heads, each step, with nothing queued)."""
    n_audio = st.n_audio
    gen = torch.Generator().manual_seed(100 + step)
    for r in range(L_F * H_F):
        if not st.on_host[r].any() or (r + step) % 4 == 0:  # nothing queued on this head this step
            continue
        sel_rec = torch.rand(n_audio, generator=gen) < 0.15
        sel_rel = torch.rand(n_audio, generator=gen) < 0.15
        pos = torch.arange(n_audio, device=dev)
        if r != L_F * H_F - 1:
            st.recall(r, pos, select=(sel_rec.to(dev) & st.on_host[r]))
        else:  # queued past the host-side room check, as a captured graph would
            st.queued_recall[r] |= sel_rec.to(dev) & st.on_host[r] & (st.slot_of[r] < 0)
        st.release(r, pos, select=(sel_rel.to(dev) & st.on_host[r] & (st.slot_of[r] >= 0) & ~st.queued_recall[r]))


def _same_store(a, b, where) -> None:
    for name in ("slot_of", "audio_pos", "n_resident", "audio_len", "overflow"):
        assert torch.equal(getattr(a, name), getattr(b, name)), (where, name)
    assert a.recalled_rows == b.recalled_rows, where
    assert torch.equal(a.audio_k[a.audio_pos >= 0], b.audio_k[b.audio_pos >= 0])
    assert torch.equal(a.audio_v[a.audio_pos >= 0], b.audio_v[b.audio_pos >= 0])
    assert not a.queued_recall.any() and not b.queued_recall.any() and not b.queued_release.any()


def _small_tiles(monkeypatch) -> None:
    """Scans of 32 positions, copy tiles of 4 pairs: every loop of the kernels runs several times on the tests'
    small stores."""
    from wnw_exp.kv import triton_moves

    monkeypatch.setattr(triton_moves, "SCAN", 32)
    monkeypatch.setattr(triton_moves, "COPY", 4)


def test_triton_flush_moves_what_the_torch_flush_moves(monkeypatch):
    """The packed store's two-launch flush (kv/triton_moves.py, reading the host mirror itself on CUDA) = its
    PyTorch flush (the specification), move for move: random recalls and releases on the heads with a host tier
    (each step some of them with nothing queued, which the kernel skips), a head too full for its recalls
    (overflow), per layer and for all layers, with small scans and tiles (`_small_tiles`)."""
    dev = _triton_env()
    _small_tiles(monkeypatch)
    stores = {kernels: _flush_store(kernels, 70, 7, dev) for kernels in ("torch", "triton")}
    for step in range(6):
        for st in stores.values():
            _queue_random(st, step, dev)
            st.flush(step % L_F if step % 3 else None)
            st.flush()
        _same_store(stores["torch"], stores["triton"], step)
    b = stores["triton"]
    assert int(b.overflow) > 0 and b.recalled_rows > 0
    with pytest.raises(RuntimeError, match="region is full"):
        b.check()
    from wnw_exp.kv.triton_moves import read_host  # the store's probe that the GPU reads the host mirror

    got, src = torch.zeros(1, device=dev), torch.tensor([3.5, 1.0])
    read_host(src.pin_memory() if HAS_CUDA else src, got)
    assert float(got[0]) == 3.5


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_a_mirror_of_the_offloading_rows_only_moves_what_the_full_mirror_moves(monkeypatch, kernels):
    """`host_mirror=rows`: only the rows that may offload have a host copy (a smaller mirror, each row at its own
    mirror row: `host_row`); recalls read the right rows, so the store moves exactly what the store with a mirror of
    every row moves (the PyTorch flush, the specification), with the PyTorch flush and with the Triton flush (its
    per-row mirror rows); a row outside them cannot be given a host tier."""
    dev = _triton_env() if kernels == "triton" else torch.device("cpu")
    if kernels == "triton":
        _small_tiles(monkeypatch)
    rows = [r for r in range(L_F * H_F) if r != 2]  # every row but the one that never offloads
    full = _flush_store("torch", 70, 7, dev)
    part = _flush_store(kernels, 70, 7, dev, host_mirror=np.array(rows[::-1]))
    assert full.host_k.shape[0] == L_F * H_F and part.host_k.shape[0] == len(rows)
    assert part.host_row.tolist() == [0, 1, -1, 2, 3, 4]
    torch.testing.assert_close(part.host_v[2:].cpu(), full.host_v[3:].cpu(), rtol=0, atol=0)
    for step in range(6):
        for st in (full, part):
            _queue_random(st, step, dev)
            st.flush(step % L_F if step % 3 else None)
            st.flush()
        _same_store(full, part, step)
    assert part.recalled_rows > 0
    resident = part.slot_of[2].ge(0).nonzero().flatten()
    with pytest.raises(ValueError, match="no host mirror"):
        part.set_tiers(0, 2, resident[:1], resident[1:3])
    with pytest.raises(ValueError, match=r"host_mirror: rows must be in \[0, 6\)"):
        _flush_store("torch", 20, 1, dev, host_mirror=[0, 6])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_flush_of_several_stores_moves_what_each_torch_flush_moves(monkeypatch, dtype):
    """`flush_stores`: a batch's stores flushed together (one `FlushTables`, one pair of launches) = each store's
    own PyTorch flush, move for move and K/V word for word (fp32 rows copied as pairs of 16-bit words, bf16 as
    one): four stores of three audio lengths, one whose heads cannot move (no host copy), one with PyTorch moves
    (flushed on its own), one leaving the set after three steps (the tables are rebuilt for the others, and it is
    left alone); random recalls and releases, some heads with nothing queued, a head too full (overflow)."""
    dev = _triton_env()
    _small_tiles(monkeypatch)
    from wnw_exp.kv.packed import flush_stores

    specs = [(70, 7, True, "triton"), (41, 8, True, "triton"), (70, 9, False, "triton"), (90, 10, True, "torch")]
    pairs = [tuple(_flush_store(k, n, seed, dev, mirrored, dtype) for k in ("torch", kernels))
             for n, seed, mirrored, kernels in specs]
    held: dict = {}
    made = []
    for step in range(6):
        batch = pairs if step < 3 else pairs[:1] + pairs[2:]  # the second store leaves after three steps
        for ref, st in batch:
            _queue_random(ref, step, dev)
            _queue_random(st, step, dev)
            ref.flush()
        flush_stores([st for _, st in batch], held)
        for j, (ref, st) in enumerate(pairs):
            _same_store(ref, st, (step, j))
        tables = held["tables"]
        assert tables.n_rows == (L_F * H_F - 1) * (2 if step < 3 else 1)  # the movable rows of the Triton stores
        assert not tables.count.any()  # the pair list is empty again for the next flush
        made.append(tables)
    assert made[0] is made[2] and made[2] is not made[3] and made[3] is made[5]
    for j in (0, 1):
        st = pairs[j][1]
        assert int(st.overflow) > 0 and st.recalled_rows > 0
    assert pairs[2][1].recalled_rows == 0 and pairs[3][1].recalled_rows > 0


def test_one_record_of_several_stores_records_what_each_torch_record_step_records(monkeypatch):
    """`record_steps`: a batch's stores' step accounting in one launch (`RecordTables`) = each store's own PyTorch
    `record_step`, step by step: three Triton stores of two audio lengths and one with PyTorch kernels (recorded on
    its own), moves flushed between the steps so the counts change; the tables made once."""
    dev = _triton_env()
    from wnw_exp.kv.packed import record_steps

    specs = [(70, 7, "triton"), (41, 8, "triton"), (70, 9, "triton"), (90, 10, "torch")]
    pairs = [tuple(_flush_store(k, n, seed, dev) for k in ("torch", kernels)) for n, seed, kernels in specs]
    held: dict = {}
    made = []
    for step in range(5):
        for ref, st in pairs:
            for x in (ref, st):
                _queue_random(x, step, dev)
                x.flush()
            ref.record_step()
        record_steps([st for _, st in pairs], held)
        made.append(held["record"])
        for ref, st in pairs:
            assert ref.steps == st.steps and len(st.steps) == step + 1
    assert held["record"].n == 3 and all(m is made[0] for m in made)
    assert len({s.n_gpu for s in pairs[0][1].steps}) > 1  # the resident count moved


@pytest.mark.parametrize("case", ["voxtral-full", "voxtral-wnw", "qwen_omni-arkvale"])
def test_fused_triton_step_matches_the_torch_step(case):
    """The whole fused step with its Triton kernels (CUDA, else the interpreter) = with their PyTorch equivalents."""
    dev = _triton_env()
    family, method = case.split("-")
    backbone = (tiny_voxtral if family == "voxtral" else tiny_qwen_omni)()
    backbone.model.to(dev)
    backbone.eos_token_ids = [-1]
    prompt = backbone.build_prompt(noise_audio(20.0))
    runs = _runs(backbone, prompt, method, dict(torch=FUSED_TORCH, triton=dict(FUSED_TORCH, kernels="triton")), n_new=8)
    _same_run(runs["triton"], runs["torch"], 1e-3 if HAS_CUDA else 1e-4)  # fp32 products run as tf32 on CUDA


@pytest.mark.parametrize("family", ["voxtral", "qwen_omni"])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
@torch.no_grad()
def test_the_fused_prefill_layer_computes_the_hf_layer(family, kernels):
    """`engine.step.prefill_layer` (the fused weights, the step's kernels, `rope_split`) = `decoder_layer` (the
    backbone's HF modules) layer by layer over a whole prompt: the same q, k, v handed to the attention, the same
    hidden states; M-RoPE (Qwen) and q|k|v biases included."""
    from wnw_exp.backbones.layer import causal_attention, decoder_layer
    from wnw_exp.engine.step import prefill_layer

    dev = _triton_env() if kernels == "triton" else torch.device("cpu")
    bb = (tiny_voxtral if family == "voxtral" else tiny_qwen_omni)()
    bb.model.to(dev)
    prompt = bb.build_prompt(noise_audio(6.0))
    hidden = bb.embed_prompt(prompt)
    cos, sin = bb.rotary(hidden, bb.prompt_positions(prompt))
    dims = (bb.n_q_heads, bb.n_kv_heads, bb.head_dim)
    tol = dict(atol=2e-3, rtol=2e-3) if HAS_CUDA else dict(atol=2e-5, rtol=2e-5)  # tf32 GEMMs on CUDA
    for li, (layer, w) in enumerate(zip(bb.layers, bb.fused_layers())):
        seen = []

        def attention(q, k, v, scale):
            seen.append((q, k, v))
            return causal_attention(q, k, v, scale)

        ref = decoder_layer(layer, hidden, cos, sin, attention, dims)
        got = prefill_layer(w, hidden, cos, sin, attention, dims, kernels=kernels)
        for a, b in zip(seen[1], seen[0]):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, **tol)
        torch.testing.assert_close(got, ref, **tol)
        hidden = ref
    assert li == bb.n_layers - 1


@pytest.mark.parametrize("shape", [(4, 2, 80, (10, 60), 32), (8, 2, 150, (5, 140), 32), (6, 3, 45, (0, 40), 32),
                                   (4, 2, 70, (10, 50), 8)])
def test_the_prefill_scores_kernel_computes_the_torch_scores(shape):
    """`triton_ops.prefill_probs` (one launch, online softmax) = `decode._probs_to_audio` (fp32 matmul, causal mask,
    softmax, the audio columns) for the rows `prefill_scores` asks: the observation window, and the rows after the
    audio where there are more (a prompt whose audio ends early), with grouped query heads; a head_dim under 16 (the
    tiny models') multiplies without `tl.dot`."""
    from wnw_exp.engine.decode import OBSERVATION_WINDOW, _probs_to_audio, prefill_scores

    dev = _triton_env()
    from wnw_exp.engine.triton_ops import prefill_probs

    n_q, n_kv, T, span, D = shape
    g = torch.Generator().manual_seed(T)
    q, k = (torch.randn(n, T, D, generator=g).to(dev) for n in (n_q, n_kv))
    first = min(span[1], max(0, T - OBSERVATION_WINDOW))
    want = _probs_to_audio(q, k, span, 0.3, first)
    got = prefill_probs(q, k, span, 0.3, first)
    assert got.shape == want.shape == (n_q, T - first, span[1] - span[0])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    a, b = prefill_scores(q, k, span, 0.3, "triton"), prefill_scores(q, k, span, 0.3)
    for f in ("post_audio", "last_window", "audio_keys"):
        torch.testing.assert_close(getattr(a, f), getattr(b, f), atol=1e-6, rtol=1e-5)


BLOCKED = ("hydra", "omegaconf", "soxr", "soundfile", "espeakng", "jiwer")


def test_decode_benchmark_smoke_runs_every_row_on_the_cpu(tmp_path):
    out = tmp_path / "smoke.json"
    # As on the GPU machine, where these are not installed: `None` in sys.modules makes an import fail and
    # importlib.util.find_spec report the package missing (so transformers does not use soundfile either).
    code = ("import runpy, sys; sys.modules.update({m: None for m in %r}); "
            "sys.argv = ['decode_speed.py', '--smoke', '--profile', '2', '--out', %r]; "
            "runpy.run_path(%r, run_name='__main__')") % (BLOCKED, str(out), str(ROOT / "benchmarks/decode_speed.py"))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    errors = {k: v["error"] for k, v in res.items() if isinstance(v, dict) and "error" in v}
    assert not errors
    check = res["tiny/200/fused_vs_reference"]
    assert check["same_tokens_prefix"] == check["steps"] and check["max_abs_logit_diff"] < 1e-3
    for shape in ("tiny", "tiny_qwen"):
        for n in (200, 500):
            p = f"{shape}/{n}"
            for row in ("engine_full", "engine_adakv_r0.2", "engine_arkvale_r0.2", "engine_wnw_r0.2",
                        "engine_wnw_r0.2_recall_off", "engine_wnw_r0.2_pipelined"):
                assert res[f"{p}/{row}"]["ms_per_token"] > 0
                assert res[f"{p}/{row}"]["fused"] and res[f"{p}/{row}"]["store"] == "packed"  # the engine's fast path
            assert res[f"{p}/engine_arkvale_r0.2"]["h2d_mb_per_step"] > 0  # ArkVale really recalls pages
            assert res[f"{p}/engine_wnw_r0.2"]["steps_with_h2d"] > 0  # the scripted anchors make WnW recall
            assert res[f"{p}/engine_wnw_r0.2_recall_off"]["h2d_mb_per_step"] == 0
            assert res[f"{p}/engine_adakv_r0.2"]["audio_kv_bytes"] < 0.3 * res[f"{p}/engine_full"]["audio_kv_bytes"]
    for n_tidal in (3, 9):  # Table 4's sweep (--smoke: 3,9 tidal heads beside one anchor, 4 steps)
        row = res[f"tiny/200/sweep_tidal{n_tidal}"]
        assert (row["knobs"]["n_tidal"], row["knobs"]["n_anchor"], row["steps"]) == (n_tidal, 1, 4)
        assert row["ms_per_token"] > 0 and row["fused"] and row["store"] == "packed"
    reference = res["tiny/200/engine_reference_full"]  # the reference path, full cache (--smoke: 3 steps)
    assert (reference["store"], reference["fused"], reference["steps"], reference["r_gpu"]) == \
        ("reference", False, 3, 1.0)
    eager = res["tiny/200/engine_full_eager"]  # no graph, full cache (--smoke: 6 steps)
    assert (eager["graph"], eager["steps"], eager["r_gpu"]) == (False, 6, 1.0) and eager["ms_per_token"] > 0
    hf = res["tiny/200/hf_generate"]  # transformers' generate (--smoke: 3 steps)
    assert hf["steps"] == 3 and hf["ms_per_token"] > 0
    for m in ("wnw", "arkvale"):  # the profiler rows name the step's costliest ops
        prof = res[f"tiny/200/profile_{m}_r0.2"]
        # (counts, not times: on a loaded CPU the decode-minus-prefill time of 2 steps can come out negative)
        assert prof["top"] and any(t["launches_per_step"] > 0 for t in prof["top"])


def _agree(a, b, min_tokens: int):
    """bf16 runs: tokens may part on near-ties; logits are compared while the inputs agree."""
    same = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), len(a.tokens))
    assert same >= min_tokens, (a.tokens, b.tokens)
    for x, y in zip(a.logits[:same + 1], b.logits[:same + 1]):
        assert (x - y).abs().max() <= 0.05 * x.abs().max() + 0.02
    return same


@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="CUDA graphs and bf16 Triton kernels need CUDA")
@pytest.mark.parametrize("method", ["full", "wnw", "arkvale", "oracle"])
def test_cuda_default_path_matches_the_eager_and_the_reference_paths(method):
    """wnw-run's CUDA default (fused step; one CUDA graph per token holding the method's decisions and the store's
    moves when the method is graph-safe, else the fused step eagerly) against the same step run eagerly, and
    against the reference step on the reference store."""
    from wnw_exp.engine.decode import decode_path

    backbone = tiny_voxtral()
    backbone.model.to("cuda", torch.bfloat16)
    backbone.eos_token_ids = [-1]
    prompt = backbone.build_prompt(noise_audio(20.0))
    runs = _runs(backbone, prompt, method, dict(default={}, eager=dict(graph=False),
                                                 reference=dict(store="reference", fused=False)), n_new=12)
    (d, pd), (e, _), (r, _) = runs["default"], runs["eager"], runs["reference"]
    assert decode_path(backbone.device, pd).graph == (method != "oracle")
    if _agree(d, e, 6) == 12:
        assert d.trace == e.trace  # the same decisions from the graph as from eager launches
    # the reference path runs the prefill in the backbone's HF modules, the default in the fused kernels: in bf16 the
    # prefill scores round apart, and on noise audio a near-tie may place another position, after which the runs
    # part. So the prefill's own logits are compared for every method, the decode steps where nothing is placed
    # (`test_fused_step_matches_the_reference_step` compares the steps decision by decision on one prefill, in fp32).
    if method == "full":
        _agree(d, r, 2)
    else:
        x, y = d.logits[0], r.logits[0]
        assert (x - y).abs().max() <= 0.05 * x.abs().max() + 0.02
    if method in ("wnw", "arkvale"):
        assert d.store_summary["mb_per_step"] > 0  # recalls ran inside the graph
