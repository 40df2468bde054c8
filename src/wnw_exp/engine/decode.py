"""Prefill and greedy decode, layer by layer over the backbone's own modules, KV in the tier store.

One loop for every method and backbone; methods act only through the policy hooks.
"""

from __future__ import annotations

import importlib.util
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from wnw_exp.backbones.base import Backbone, Prompt
from wnw_exp.kv.store import AudioKVStore
from wnw_exp.methods.base import Policy, PrefillScores, SampleContext


@dataclass
class DecodeResult:
    tokens: list[int]
    terminated: bool  # stopped at EOS (not at the length cap)
    step_ms: list[float]  # wall time of each decode step (the first token comes from prefill)
    prefill_ms: float
    store_summary: dict
    trace: dict = field(default_factory=dict)  # per-step records for figures
    logits: list[torch.Tensor] | None = None  # per generated token, when asked for

    @property
    def ms_per_token(self) -> float:
        if not self.step_ms:
            return float("nan")
        s = sorted(self.step_ms)
        return s[len(s) // 2]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (1, H, T, D); cos/sin: (1, T, D)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def project_qkv(layer, x: torch.Tensor, n_q: int, n_kv: int, d: int):
    """q (1, H_q, T, D), k and v (1, H_kv, T, D) from a decoder layer's own projections (before RoPE)."""
    attn = layer.self_attn
    b, t, _ = x.shape
    q = attn.q_proj(x).view(b, t, n_q, d).transpose(1, 2)
    k = attn.k_proj(x).view(b, t, n_kv, d).transpose(1, 2)
    v = attn.v_proj(x).view(b, t, n_kv, d).transpose(1, 2)
    return q, k, v


def max_new_tokens_for(duration_s: float, per_second: float, minimum: int) -> int:
    """The length cap tied to the audio duration: a transcript cannot be longer than speech allows."""
    return int(math.ceil(duration_s * per_second)) + minimum


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(backbone: Backbone, prompt: Prompt, policy: Policy, *, retention: float, max_new_tokens: int,
             keep_logits: bool = False, store: str = "auto") -> DecodeResult:
    """Greedy decoding of one prompt with `policy` managing the audio KV.

    `store`: "reference" (AudioKVStore), "packed" (PackedAudioKVStore + Triton) or "auto" (packed on CUDA
    when triton is installed and the method runs on it, `policy.packed_store`).
    """
    dev = backbone.device
    n_q, n_kv, d = backbone.n_q_heads, backbone.n_kv_heads, backbone.head_dim
    total = prompt.input_ids.shape[1] + max_new_tokens
    if total > backbone.max_positions:
        raise ValueError(f"prompt ({prompt.input_ids.shape[1]} tokens) plus {max_new_tokens} new tokens exceeds "
                         f"the model's context of {backbone.max_positions} positions: use shorter audio")
    ctx = SampleContext(backbone.n_layers, n_q, n_kv, d, backbone.token_rate, prompt.n_audio, retention, dev)
    if store == "auto":
        # The packed store (one buffer, Triton attention, recall on a side stream) is the fast path on
        # CUDA; the reference store is what it is tested against.
        fast = dev.type == "cuda" and importlib.util.find_spec("triton") and policy.packed_store
        store = "packed" if fast else "reference"
    packed = store == "packed"
    if packed:
        from wnw_exp.kv.packed import PackedAudioKVStore as store_cls
    elif store == "reference":
        store_cls = AudioKVStore
    else:
        raise ValueError(f"unknown store {store!r}: auto, reference or packed")
    store = store_cls(backbone.n_layers, n_kv, d, prompt.n_audio, dev, backbone.dtype, max_new_tokens + 1)
    policy.start(ctx, store)

    _sync(dev)
    t0 = time.perf_counter()
    hidden = backbone.embed_prompt(prompt)
    prompt_pos = backbone.prompt_positions(prompt)
    positions, span = prompt_pos, prompt.audio_span
    rope_cache: tuple | None = None
    for li, layer in enumerate(backbone.layers):
        hidden, positions, span = policy.prefill_transform(li, hidden, positions, span)
        if rope_cache is None or rope_cache[0] is not positions:
            rope_cache = (positions, *backbone.rotary(hidden, positions))
        _, cos, sin = rope_cache
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        q, k, v = project_qkv(layer, x, n_q, n_kv, d)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=True)
        store.write_prefill(li, k[0], v[0], span)
        policy.place(li, prefill_scores(q[0], k[0], span, attn.scaling))
        hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(1, hidden.shape[1], -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    if packed:
        store.compact(headroom=policy.recall_headroom)  # frees the dropped rows' memory
    policy.after_prefill()
    if packed:
        store.issue()
    logits = backbone.lm_head(backbone.final_norm(hidden[:, -1:]))[0, -1].float()
    _sync(dev)
    prefill_ms = (time.perf_counter() - t0) * 1e3

    tokens, step_ms, kept = [], [], []
    observers = {li: policy.observe_heads(li) for li in range(backbone.n_layers)}
    terminated = False
    for step in range(max_new_tokens):
        if keep_logits:
            kept.append(logits.cpu())
        token = int(torch.argmax(logits))
        tokens.append(token)
        if token in backbone.eos_token_ids:
            terminated = True
            break
        if step == max_new_tokens - 1:
            break
        t0 = time.perf_counter()
        hidden = backbone.embed_tokens(torch.tensor([[token]], device=dev))
        pos = backbone.next_positions(prompt_pos, step)
        cos, sin = backbone.rotary(hidden, pos)
        for li, layer in enumerate(backbone.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q, k, v = project_qkv(layer, x, n_q, n_kv, d)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            policy.before_attention(li, q[0, :, 0])
            out, probs = store.attend(li, q[0, :, 0], k[0, :, 0], v[0, :, 0], attn.scaling, observers[li])
            if probs is not None:
                policy.observe(li, probs)
            hidden = hidden + attn.o_proj(out.reshape(1, 1, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        policy.after_step(step)
        if packed:
            store.issue()  # start the queued recalls' copies on the side stream at once
        store.end_step()
        logits = backbone.lm_head(backbone.final_norm(hidden))[0, -1].float()
        _sync(dev)
        step_ms.append((time.perf_counter() - t0) * 1e3)

    trace = dict(gpu_audio_tokens=[s.n_gpu for s in store.steps], h2d_bytes=[s.h2d_bytes for s in store.steps],
                 n_audio=prompt.n_audio, n_full=store.n_full,
                 n_prompt_text=prompt.input_ids.shape[1] - prompt.n_audio, **policy.trace())
    return DecodeResult(tokens, terminated, step_ms, prefill_ms, store.summary(), trace,
                        kept if keep_logits else None)


OBSERVATION_WINDOW = 32  # SnapKV-style window: the last prompt rows, audio rows included


def prefill_scores(q: torch.Tensor, k: torch.Tensor, span: tuple[int, int], scale: float) -> PrefillScores:
    """What every method's `place` gets for one layer: q (H_q, T, D), k (H_kv, T, D) after RoPE."""
    return PrefillScores(_probs_to_audio(q, k, span, scale, span[1]),
                         _probs_to_audio(q, k, span, scale, max(0, q.shape[1] - OBSERVATION_WINDOW)),
                         k[:, span[0]:span[1]])


def _probs_to_audio(q: torch.Tensor, k: torch.Tensor, span: tuple[int, int], scale: float,
                    first_row: int) -> torch.Tensor:
    """Softmax weights (H_q, T - first_row, n_audio) from prompt rows first_row.. to the audio positions.

    Each row's softmax runs over every key it can see (causal), exactly as in the prefill attention.
    """
    s, e = span
    n_q, T, _ = q.shape
    g = n_q // k.shape[0]
    if first_row >= T:
        return q.new_zeros(n_q, 0, e - s)
    kk = k.repeat_interleave(g, dim=0).float()
    scores = torch.einsum("hqd,hkd->hqk", q[:, first_row:].float(), kk) * scale  # (H_q, n_rows, T)
    rows = torch.arange(first_row, T, device=q.device)[:, None]
    scores = scores.masked_fill(torch.arange(T, device=q.device)[None, :] > rows, float("-inf"))
    return torch.softmax(scores, dim=-1)[:, :, s:e]
