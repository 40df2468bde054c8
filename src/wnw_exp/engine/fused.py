"""A fused single-token decode step over the packed KV store: few, large kernels per layer.

The HF decoder layer spends about 30 small kernels per layer on one token (fp32 casts in RMSNorm,
`rotate_half` with `cat`, three q/k/v GEMVs, two MLP GEMVs, residual adds); inside one CUDA graph they,
not the weight reads, bound the step. `FusedDecoderStep` runs the same arithmetic in ~10 kernels a layer:

    add+RMSNorm -> one q|k|v GEMM -> RoPE + KV append -> attention (2 Triton kernels)
    -> o GEMM -> add+RMSNorm -> one gate|up GEMM -> SiLU*mul -> down GEMM   (the residual add of the
    down projection is fused into the next layer's add+RMSNorm)

`fuse_weights` concatenates q/k/v (and their biases, Qwen2) and gate/up once and makes the HF modules'
own parameters views into the fused tensors, so no weight is held twice and the HF modules (prefill,
generate()) keep working. cos/sin come from a table built with the model's own rotary embedding for every
position the run can reach (identical values: each entry is one product before cos/sin).

`impl="triton"` uses `engine/triton_ops.py` (CUDA, or Triton's interpreter on a CPU); `impl="torch"` the
equivalent PyTorch ops below, which round exactly where the HF modules round: the specification the
kernels are tested against. No host reads anywhere in `step`, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class FusedLayer:
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


def fuse_weights(model) -> list[FusedLayer]:
    """Per decoder layer of a HF Llama/Qwen2-style causal LM: concatenated q|k|v and gate|up weights (done
    once per model; later calls return the same tensors)."""
    if getattr(model, "_fused_layers", None) is not None:
        return model._fused_layers
    layers = []
    for layer in model.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        layers.append(FusedLayer(
            w_qkv=_fuse([a.q_proj, a.k_proj, a.v_proj], "weight"), b_qkv=_fuse([a.q_proj, a.k_proj, a.v_proj], "bias"),
            w_o=a.o_proj.weight, b_o=a.o_proj.bias,
            w_gate_up=_fuse([mlp.gate_proj, mlp.up_proj], "weight"), w_down=mlp.down_proj.weight,
            ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
            eps=float(layer.input_layernorm.variance_epsilon), scale=float(a.scaling)))
        if mlp.gate_proj.bias is not None or mlp.down_proj.bias is not None:
            raise ValueError("fused step: MLP biases are not supported")
        if type(mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
            raise ValueError(f"fused step: activation {type(mlp.act_fn).__name__} is not SiLU")
    model._fused_layers = layers
    return layers


# --- the torch equivalents of the Triton kernels (the specification) ----------------------------------
def add_rmsnorm_torch(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                      out: torch.Tensor) -> torch.Tensor:
    if delta is not None:
        hidden.add_(delta)  # a bf16 add rounds once, as `hidden + out` in the HF layer
    x = hidden.float()
    y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(hidden.dtype)
    torch.mul(weight, y, out=out)
    return out


def rope_append_torch(qkv, cos_table, sin_table, pos, dense_len, q_out, dense_k, dense_v, n_q, n_kv, head_dim):
    x = qkv.view(n_q + 2 * n_kv, head_dim)
    qk = x[: n_q + n_kv]
    cos, sin = cos_table.index_select(0, pos.view(1)), sin_table.index_select(0, pos.view(1))  # (1, D)
    h = head_dim // 2
    rot = torch.cat([-qk[:, h:], qk[:, :h]], dim=-1)
    y = qk * cos + rot * sin  # each product and the sum round to the model dtype, as HF's apply_rotary_pos_emb
    q_out.copy_(y[:n_q])
    dense_k.index_copy_(1, dense_len.view(1), y[n_q:, None])
    dense_v.index_copy_(1, dense_len.view(1), x[n_q + n_kv:, None])
    return q_out


def silu_mul_torch(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    n = out.numel()
    torch.mul(F.silu(gate_up[:n]), gate_up[n:], out=out)
    return out


def decode_attention_torch(q: torch.Tensor, dense_k: torch.Tensor, dense_v: torch.Tensor, dense_len: torch.Tensor,
                           audio_k: torch.Tensor, audio_v: torch.Tensor, audio_off: torch.Tensor,
                           audio_len: torch.Tensor, scale: float, *, max_audio_per_head: int,
                           audio_pos: torch.Tensor | None = None, observe: torch.Tensor | None = None,
                           probs_out: torch.Tensor | None = None, scratch: dict | None = None) -> torch.Tensor:
    """`kv.triton_attention.decode_attention` in PyTorch (same arguments, same layout, no host reads): each
    head's audio rows are gathered up to `max_audio_per_head` and masked by the device lengths."""
    H_q, D = q.shape
    H, Cd = dense_k.shape[:2]
    G = H_q // H
    A = max(int(max_audio_per_head), 1)
    ar = torch.arange(A, device=q.device)
    idx = (audio_off.long()[:, None] + ar[None]).clamp(max=audio_k.shape[0] - 1)  # (H, A)
    k = torch.cat([dense_k, audio_k[idx]], dim=1).float()
    v = torch.cat([dense_v, audio_v[idx]], dim=1).float()
    valid = torch.cat([(torch.arange(Cd, device=q.device) < dense_len.view(1))[None].expand(H, Cd),
                       ar[None] < audio_len.view(H, 1)], dim=1)  # (H, Cd + A)
    v = v.masked_fill(~valid[..., None], 0.0)  # rows past the lengths are uninitialised memory (NaN * 0 = NaN)
    s = torch.einsum("hgd,hnd->hgn", q.view(H, G, D).float(), k) * scale
    s = s.masked_fill(~valid[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    out = torch.einsum("hgn,hnd->hgd", p, v).to(q.dtype).reshape(H_q, D)
    if observe is not None and len(observe):
        obs = observe.long()
        heads = obs // G
        w = p.reshape(H_q, Cd + A)[obs, Cd:] * valid[heads, Cd:]  # (n_obs, A), 0 where not resident
        probs_out.zero_()
        probs_out.scatter_add_(1, audio_pos[idx[heads]].long(), w)
    return out


def _ops(impl: str):
    """(add_rmsnorm, rope_append, silu_mul, decode_attention) of an implementation."""
    if impl == "triton":
        from wnw_exp.engine import triton_ops as t
        from wnw_exp.kv.triton_attention import decode_attention
        return t.add_rmsnorm, t.rope_append, t.silu_mul, decode_attention
    if impl == "torch":
        return add_rmsnorm_torch, rope_append_torch, silu_mul_torch, decode_attention_torch
    raise ValueError(f"unknown fused impl {impl!r}: triton or torch")


class FusedDecoderStep:
    """One greedy decode step of a HF Llama/Qwen2 causal LM over a `PackedAudioKVStore`, in static buffers.

    `tok` (1, 1) and `pos` (1,) are device tensors updated in place (next token, next position); the store's
    `dense_len` advances by one. `observe[layer]` = (query-head indices int32, probs buffer) asks the
    attention kernel for those heads' softmax weights at audio positions, handed to `on_probs(layer, probs)`
    (WnW's `observe`); `on_layer(layer, q)` gets the step's RoPE'd query (H_q, D) right after it is computed
    (ArkVale's page scores). Both run inside the captured graph, so they must be graph-safe too.
    """

    def __init__(self, model, store, max_positions: int, impl: str = "triton"):
        cfg = model.config
        self.model, self.store = model, store
        self.n_q, self.n_kv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.layers = fuse_weights(model)
        self.norm_f = model.model.norm.weight
        self.eps_f = float(model.model.norm.variance_epsilon)
        self.add_rmsnorm, self.rope_append, self.silu_mul, self.attention = _ops(impl)
        dev, dt = store.device, model.dtype
        emb = model.model.embed_tokens.weight
        with torch.no_grad():
            pos = torch.arange(max_positions, device=dev)[None]
            cos, sin = model.model.rotary_emb(emb[:1], pos)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()  # (P, D) in the model dtype
        hid, inter = cfg.hidden_size, self.layers[0].w_down.shape[1]
        self.hidden = torch.zeros(hid, device=dev, dtype=dt)
        self.normed = torch.empty(hid, device=dev, dtype=dt)
        self.q = torch.empty(self.n_q, self.d, device=dev, dtype=dt)
        self.act = torch.empty(inter, device=dev, dtype=dt)
        self.dlen_plus = torch.zeros(1, device=dev, dtype=torch.long)
        self.tok = torch.zeros(1, 1, device=dev, dtype=torch.long)
        self.pos = torch.zeros(1, device=dev, dtype=torch.long)
        self.observe: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.on_layer = None  # callable(layer, q (H_q, D)) or None
        self.on_probs = None  # callable(layer, probs (n_observe, n_audio)) or None

    @torch.no_grad()
    def step(self) -> None:
        s, dk, dv = self.store, self.store.dense_k, self.store.dense_v
        torch.add(s.dense_len, 1, out=self.dlen_plus)  # once per step: every layer sees the same length
        torch.index_select(self.model.model.embed_tokens.weight, 0, self.tok.view(1), out=self.hidden.view(1, -1))
        delta = None
        for li, w in enumerate(self.layers):
            self.add_rmsnorm(self.hidden, delta, w.ln1, w.eps, self.normed)
            qkv = F.linear(self.normed, w.w_qkv, w.b_qkv)
            self.rope_append(qkv, self.cos, self.sin, self.pos, s.dense_len, self.q, dk[li], dv[li],
                             self.n_q, self.n_kv, self.d)
            if self.on_layer is not None:
                self.on_layer(li, self.q)
            obs, probs = self.observe.get(li, (None, None))
            out = self.attention(self.q, dk[li], dv[li], self.dlen_plus, s.audio_k, s.audio_v, s.offsets(li),
                                   s.audio_len[li], w.scale, max_audio_per_head=int(s.caps.max()),
                                   audio_pos=s.audio_pos, observe=obs, probs_out=probs, scratch=s._scratch[li])
            if obs is not None and self.on_probs is not None:
                self.on_probs(li, probs)
            delta = F.linear(out.view(-1), w.w_o, w.b_o)
            self.add_rmsnorm(self.hidden, delta, w.ln2, w.eps, self.normed)
            self.silu_mul(F.linear(self.normed, w.w_gate_up), self.act)
            delta = F.linear(self.act, w.w_down)
        self.add_rmsnorm(self.hidden, delta, self.norm_f, self.eps_f, self.normed)
        self.logits = logits = F.linear(self.normed, self.model.lm_head.weight, self.model.lm_head.bias)
        torch.argmax(logits, dim=-1, keepdim=True, out=self.tok.view(1))
        self.pos += 1
        s.dense_len += 1

