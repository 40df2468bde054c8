"""The oracle method against an independent reference: transformers' own generate() with an attention function
that, at each decode step, keeps only each KV head's top-r audio positions of that step's true attention."""

import math
import os

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from helpers import interpreted_prefill_in_torch, noise_audio, tiny_voxtral
from test_engine import hf_generate
from wnw_exp.engine.serve import generate
from wnw_exp.methods import build_policy

N_NEW = 24


def masked_oracle_attention(span, k_keep, block):
    """A decode-step attention that ranks audio keys like the oracle (softmax over the keys before the new
    token, summed over the GQA group) and attends to the top `k_keep` blocks of `block` audio tokens only."""
    s, e = span

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if query.shape[2] > 1:  # prefill: plain causal attention
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        h_kv, g = key.shape[1], query.shape[1] // key.shape[1]
        kk = key.repeat_interleave(g, dim=1).float()
        vv = value.repeat_interleave(g, dim=1).float()
        logits = torch.einsum("bhqd,bhkd->bhqk", query.float(), kk) * scaling  # (1, H_q, 1, T)
        rank = torch.softmax(logits[..., :-1], dim=-1)[0, :, 0, s:e].view(h_kv, g, -1).sum(1)  # (H_kv, n)
        n = e - s
        n_blocks = math.ceil(n / block)
        mass = torch.nn.functional.pad(rank, (0, n_blocks * block - n)).view(h_kv, n_blocks, block).sum(-1)
        top = torch.sort(mass, dim=-1, descending=True, stable=True).indices[:, :k_keep]
        keep = torch.zeros(h_kv, n_blocks, dtype=torch.bool).scatter_(1, top, True).repeat_interleave(block, 1)[:, :n]
        drop = torch.zeros(h_kv, logits.shape[-1], dtype=torch.bool)
        drop[:, s:e] = ~keep
        logits = logits.masked_fill(drop.repeat_interleave(g, 0)[None, :, None], float("-inf"))
        out = torch.einsum("bhqk,bhkd->bhqd", torch.softmax(logits, dim=-1), vv)
        return out.transpose(1, 2).to(query.dtype), None

    return attention


@pytest.mark.parametrize("granularity,retention", [("token", 0.2), ("chunk", 0.4)])
def test_oracle_matches_transformers_with_per_step_top_r_masking(granularity, retention):
    backbone = tiny_voxtral()
    backbone.eos_token_ids = [-1]
    prompt = backbone.build_prompt(noise_audio(12.0))
    n = prompt.n_audio
    policy = build_policy({"name": "oracle", "granularity": granularity, "chunk_seconds": 4.0}, backbone.describe())
    ours = generate(backbone, prompt, policy, retention=retention, max_new_tokens=N_NEW, keep_logits=True)
    block = 1 if granularity == "token" else math.ceil(4.0 * backbone.token_rate)
    k_keep = round(retention * math.ceil(n / block))
    AttentionInterface.register("oracle_reference", masked_oracle_attention(prompt.audio_span, k_keep, block))
    backbone.model.set_attn_implementation("oracle_reference")
    try:
        ref_tokens, ref_logits = hf_generate(backbone, prompt, N_NEW)
    finally:
        backbone.model.set_attn_implementation("sdpa")
    assert ours.tokens == ref_tokens
    assert len(set(ref_tokens)) > 3
    for a, b in zip(ours.logits, ref_logits):
        assert (a - b[0].float()).abs().max() < 1e-4
    # every decode step holds exactly the kept blocks of every head (the last block may be short)
    per_head = [s.n_gpu / (backbone.n_layers * backbone.n_kv_heads) for s in policy.store.steps]
    if granularity == "token":
        assert all(x == k_keep for x in per_head)
    else:
        assert all(k_keep * block - block < x <= k_keep * block for x in per_head)
    assert ours.store_summary["r_gpu_cpu"] == 1.0


def test_oracle_at_full_retention_is_full_cache():
    backbone = tiny_voxtral()
    backbone.eos_token_ids = [-1]
    prompt = backbone.build_prompt(noise_audio(6.0))
    full = generate(backbone, prompt, build_policy({"name": "full"}), retention=1.0, max_new_tokens=12)
    ours = generate(backbone, prompt, build_policy({"name": "oracle"}, backbone.describe()), retention=1.0,
                    max_new_tokens=12)
    assert ours.tokens == full.tokens and ours.store_summary["mb_per_step"] == 0


def test_oracle_refuses_an_unknown_granularity():
    with pytest.raises(ValueError, match="granularity"):
        build_policy({"name": "oracle", "granularity": "page"})


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_oracle_on_the_packed_store_is_the_reference_stores(kernels, monkeypatch):
    """The oracle's decision queued as data (`queue_pages`) on the packed store, the GPU's (on the CPU: the fused
    step with PyTorch kernels, or Triton's interpreter), gives the reference store's tokens and logits, the same
    resident share at every step and the same recalls. (Interpreted, the prefill runs `prefill_layer`'s PyTorch
    kernels: the decode is under test here, the Triton prefill layer in test_fused_decode.)"""
    if kernels == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
        interpreted_prefill_in_torch(monkeypatch)
    backbone = tiny_voxtral()
    backbone.eos_token_ids = [-1]
    prompt = backbone.build_prompt(noise_audio(12.0))
    runs, steps = {}, {}
    for store, path in (("reference", {}), ("packed", dict(store="packed", fused=True, kernels=kernels))):
        policy = build_policy({"name": "oracle", "granularity": "chunk", "chunk_seconds": 2.0}, backbone.describe())
        runs[store] = generate(backbone, prompt, policy, retention=0.3, max_new_tokens=N_NEW, keep_logits=True, **path)
        steps[store] = [s.n_gpu for s in policy.store.steps]
    ref, packed = runs["reference"], runs["packed"]
    assert packed.tokens == ref.tokens and len(set(ref.tokens)) > 3
    for a, b in zip(packed.logits, ref.logits):
        assert (a - b).abs().max() < 1e-4
    assert steps["packed"] == steps["reference"] and len(steps["reference"]) >= N_NEW - 1
    assert packed.store_summary["r_gpu"] == ref.store_summary["r_gpu"] < 0.3
    assert packed.store_summary["mb_per_step"] > 0
