"""The fused decode step (engine/fused.py) and the GPU decode benchmark (benchmarks/decode_speed.py).

- the fused step (torch ops) gives the HF modules' logits and tokens, Llama and Qwen2 layouts (CPU, fp32);
- each Triton kernel of the step (engine/triton_ops.py) and the kernel attention match their torch
  equivalents: on CUDA, else in Triton's interpreter; skipped cleanly without triton;
- `decode_attention_torch` (the benchmark's CPU attention) matches the reference store;
- `decode_speed.py --smoke` runs every row at tiny dims on the CPU, importing nothing that the GPU machine
  lacks (hydra, omegaconf, soxr, soundfile, espeak, jiwer).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON and not HAS_CUDA and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything (transformers too) imports triton


def _bench():
    spec = importlib.util.spec_from_file_location("decode_speed", ROOT / "benchmarks/decode_speed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.DEV = "cpu"
    return mod


@pytest.mark.parametrize("shape", ["tiny", "tiny_qwen"])
def test_fused_step_matches_the_hf_modules(shape):
    bench = _bench()
    model = bench.build_model(shape)
    ids, span = bench.make_prompt(60, model.config.vocab_size)
    runs = {}
    for fused in (False, True):
        d = bench.FastDecoder(model, ids, span, 12, fused=fused, impl="torch")
        d.run(5, keep_tokens=True)
        runs[fused] = d.tokens
    for (t0, l0), (t1, l1) in zip(runs[False], runs[True]):
        assert int(t0) == int(t1)
        torch.testing.assert_close(l1, l0, atol=1e-4, rtol=1e-5)
    # the HF modules still work on the fused weights (views into the concatenated tensors)
    layer = model.model.layers[0].self_attn
    assert layer.k_proj.weight.data_ptr() == layer.q_proj.weight.data_ptr() + layer.q_proj.weight.numel() * 4


def _triton_env():
    if not HAS_TRITON:
        pytest.skip("triton is not installed (optional `gpu` extra)")
    if not HAS_CUDA:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("triton was imported without TRITON_INTERPRET=1 and there is no CUDA")
        os.environ["TRITON_INTERPRET"] = "1"
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not HAS_CUDA, reason="bf16 kernels on CUDA"))])
def test_triton_step_kernels_match_torch(dtype):
    dev = _triton_env()
    from wnw_exp.engine import fused as fz
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
    # SiLU * up
    gu = torch.randn(2 * inter, device=dev).to(dtype)
    a, b = torch.empty(inter, device=dev, dtype=dtype), torch.empty(inter, device=dev, dtype=dtype)
    torch.testing.assert_close(tr.silu_mul(gu, b), fz.silu_mul_torch(gu, a), **tol)


def test_torch_attention_matches_the_kernel_and_the_reference_store():
    from wnw_exp.engine.fused import decode_attention_torch
    from wnw_exp.kv.store import AudioKVStore

    torch.manual_seed(3)
    n_q, n_kv, D, n_audio, pre, post = 8, 2, 32, 90, 4, 6
    T = pre + n_audio + post
    store = AudioKVStore(1, n_kv, D, n_audio, torch.device("cpu"), torch.float32, dense_capacity=4)
    k, v = torch.randn(n_kv, T, D), torch.randn(n_kv, T, D)
    store.write_prefill(0, k, v, (pre, pre + n_audio))
    for h in range(n_kv):
        perm = torch.randperm(n_audio)
        store.set_tiers(0, h, perm[: 20 + 15 * h], perm[40:50])
    cap = 60
    ak, av = torch.randn(n_kv * cap, D) * 50, torch.randn(n_kv * cap, D) * 50  # garbage past the lengths
    apos = torch.zeros(n_kv * cap, dtype=torch.int32)
    for h, t in enumerate(store.heads[0]):
        n = len(t.gpu_pos)
        ak[h * cap: h * cap + n], av[h * cap: h * cap + n], apos[h * cap: h * cap + n] = t.gpu_k, t.gpu_v, t.gpu_pos.int()
    off = torch.arange(n_kv, dtype=torch.int32) * cap
    lens = torch.tensor([len(t.gpu_pos) for t in store.heads[0]], dtype=torch.int32)
    dk, dv, n_d = store.dense_k[0].clone(), store.dense_v[0].clone(), store.dense_len[0]
    q, kn, vn = torch.randn(n_q, D), torch.randn(n_kv, D), torch.randn(n_kv, D)
    observe = [0, 5, 7]
    ref_out, ref_probs = store.attend(0, q, kn, vn, D ** -0.5, observe)
    dk[:, n_d], dv[:, n_d] = kn, vn
    probs = torch.full((3, n_audio), 9.0)
    out = decode_attention_torch(q, dk, dv, torch.tensor([n_d + 1]), ak, av, off, lens, D ** -0.5,
                                 max_audio_per_head=cap, audio_pos=apos, observe=torch.tensor(observe, dtype=torch.int32),
                                 probs_out=probs)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(probs, ref_probs, atol=1e-6, rtol=1e-5)


BLOCKED = ("hydra", "omegaconf", "soxr", "soundfile", "espeakng", "jiwer")


def test_decode_benchmark_smoke_runs_every_row_on_the_cpu(tmp_path):
    out = tmp_path / "smoke.json"
    # As on the GPU machine, where these are not installed: `None` in sys.modules makes an import fail and
    # importlib.util.find_spec report the package missing (so transformers does not use soundfile either).
    code = ("import runpy, sys; sys.modules.update({m: None for m in %r}); "
            "sys.argv = ['decode_speed.py', '--smoke', '--out', %r]; "
            "runpy.run_path(%r, run_name='__main__')") % (BLOCKED, str(out), str(ROOT / "benchmarks/decode_speed.py"))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    errors = {k: v["error"] for k, v in res.items() if isinstance(v, dict) and "error" in v}
    assert not errors
    check = res["tiny/200/fused_vs_unfused_tokens"]
    assert check["same_tokens_prefix"] == check["steps"] and check["max_abs_logit_diff"] < 1e-3
    for shape in ("tiny", "tiny_qwen"):
        for n in (200, 500):
            p = f"{shape}/{n}"
            for row in ("fast_full", "fast_adakv_r0.2", "fast_arkvale_r0.2", "fast_wnw_r0.2",
                        "fast_wnw_r0.2_recall_off", "fast_wnw_r0.2_pipelined"):
                assert res[f"{p}/{row}"]["ms_per_token"] > 0
            assert res[f"{p}/fast_arkvale_r0.2"]["h2d_mb_per_step"] > 0  # ArkVale really recalls pages
            assert res[f"{p}/fast_wnw_r0.2"]["steps_with_h2d"] > 0  # the scripted anchors make WnW recall
            assert res[f"{p}/fast_wnw_r0.2_recall_off"]["h2d_mb_per_step"] == 0
            assert res[f"{p}/fast_adakv_r0.2"]["audio_kv_bytes"] < 0.3 * res[f"{p}/fast_full"]["audio_kv_bytes"]
    assert {"tiny/200/sweep_tidal3", "tiny/200/sweep_tidal9", "tiny/200/engine_as_written_full",
            "tiny/200/fast_full_unfused", "tiny/200/hf_generate"} <= set(res)


@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="CUDA graphs and bf16 Triton kernels need CUDA")
def test_fused_graph_matches_the_hf_modules_on_cuda():
    bench = _bench()
    bench.DEV = "cuda"
    model = bench.build_model("tiny")
    ids, span = bench.make_prompt(300, model.config.vocab_size)
    res = bench.fused_matches_unfused(model, ids, span, 8, "triton")
    # bf16 random weights give near-tied logits, so tokens may part; logits are compared while inputs agree
    assert res["max_abs_logit_diff"] <= 0.05 * res["max_abs_logit"] + 0.02
