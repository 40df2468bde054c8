"""The decoder layer, written once: the body every pass runs (the engine's prefill and reference decode step,
calibration's teacher-forced pass), and the fused per-layer weights the fast decode step reads
(`Backbone.fused_layers`).

`decoder_layer` runs a Llama / Qwen2 layer through the backbone's own HF modules (RMSNorm, the q/k/v/o
projections, the gated MLP), with RoPE from a cos/sin the caller hands in and attention left to the caller
(`attention(q, k, v, scale) -> out`: causal SDPA at prefill, the KV store at decode, SDPA with the keys kept for
autograd in calibration). It rounds where the HF modules round, so with full attention it is the model.

`fuse_layers` concatenates each layer's q|k|v (and their biases, Qwen2) and gate|up weights once and makes the HF
modules' own parameters views into the fused tensors: no weight is held twice, and the HF modules (prefill,
generate(), this body) compute exactly what they computed before (same values, same layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass
class LayerWeights:
    """One decoder layer's weights as the fused step reads them (views of the HF parameters)."""

    w_qkv: torch.Tensor  # (n_q D + 2 n_kv D, hidden)
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor
    b_o: torch.Tensor | None
    w_gate_up: torch.Tensor  # (2 I, hidden)
    w_down: torch.Tensor
    ln1: torch.Tensor
    ln2: torch.Tensor
    eps: float
    scale: float


def _fuse(mods: list[torch.nn.Linear], name: str) -> torch.Tensor | None:
    parts = [getattr(m, name) for m in mods]
    if all(p is None for p in parts):
        return None
    fused = torch.cat([p.data for p in parts], dim=0)
    start = 0
    for m in mods:  # the modules' own parameters become views: the separate tensors are freed
        n = getattr(m, name).shape[0]
        getattr(m, name).data = fused[start:start + n]
        start += n
    return fused


def fuse_layers(layers) -> list[LayerWeights]:
    """Fused q|k|v and gate|up weights of every Llama/Qwen2-style decoder layer in `layers`."""
    out = []
    for layer in layers:
        a, mlp = layer.self_attn, layer.mlp
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not type(norm).__name__.endswith("RMSNorm") or not hasattr(norm, "variance_epsilon"):
                raise ValueError(f"fused step: {type(norm).__name__} is not an RMSNorm")
        if mlp.gate_proj.bias is not None or mlp.down_proj.bias is not None:
            raise ValueError("fused step: MLP biases are not supported")
        if type(mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
            raise ValueError(f"fused step: activation {type(mlp.act_fn).__name__} is not SiLU")
        out.append(LayerWeights(
            w_qkv=_fuse([a.q_proj, a.k_proj, a.v_proj], "weight"), b_qkv=_fuse([a.q_proj, a.k_proj, a.v_proj], "bias"),
            w_o=a.o_proj.weight, b_o=a.o_proj.bias,
            w_gate_up=_fuse([mlp.gate_proj, mlp.up_proj], "weight"), w_down=mlp.down_proj.weight,
            ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
            eps=float(layer.input_layernorm.variance_epsilon), scale=float(a.scaling)))
    return out


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


Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def decoder_layer(layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention,
                  dims: tuple[int, int, int]) -> torch.Tensor:
    """One decoder layer on hidden (1, T, hidden_size): attention(q, k, v, scale) gets q (1, H_q, T, D) and k, v
    (1, H_kv, T, D) after RoPE and returns (1, H_q, T, D)."""
    attn = layer.self_attn
    q, k, v = project_qkv(layer, layer.input_layernorm(hidden), *dims)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out = attention(q, k, v, attn.scaling)
    hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(1, hidden.shape[1], -1))
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Full causal attention over the prompt (grouped-query)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
