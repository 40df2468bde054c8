"""Triton kernels of the fused decode step (one token, batch 1): what `engine/step.py` (`FusedStep`) calls on CUDA.

Each kernel replaces a chain of small PyTorch ops of the HF decoder layer by one launch, with the same
rounding sequence as the HF modules in the model dtype (every intermediate that HF rounds to bf16 is
rounded here too), so the fused step matches the unfused one up to the last ulp of an fp32 reduction:
- `add_rmsnorm`: residual add (hidden += delta, in place) then RMSNorm (fp32 statistics, normalised value
  rounded to the model dtype, times the weight), as LlamaRMSNorm / Qwen2RMSNorm after `hidden + out`.
- `rope_append`: RoPE on the step's q and k heads (cos/sin read from a table at the device position),
  q written to a buffer, k and v written into the layer's dense KV cache at the device length: no host
  read, so it can be captured in a CUDA graph.
- `silu_mul`: act(gate) * up of the gated MLP from one concatenated gate/up projection.
The torch equivalents are in `engine/step.py` (`*_torch`), the specification these are tested against.
Import this module only where `triton` is installed; on a CPU set TRITON_INTERPRET=1 before importing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rmsnorm_kernel(h_ptr, d_ptr, w_ptr, out_ptr, N, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    h = tl.load(h_ptr + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + cols, mask=ok, other=0.0)
        h = (h.to(tl.float32) + d.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + cols, h, mask=ok)
    x = h.to(tl.float32)
    var = tl.sum(x * x, axis=0) / N
    y = (x * (1.0 / tl.sqrt(var + eps))).to(h_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + cols, (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)


def add_rmsnorm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                out: torch.Tensor) -> torch.Tensor:
    """hidden (N,) += delta (in place, when given); out (N,) = RMSNorm(hidden) * weight."""
    N = hidden.numel()
    _add_rmsnorm_kernel[(1,)](hidden, delta if delta is not None else hidden, weight, out, N, eps,
                              HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(N), num_warps=8)
    return out


@triton.jit
def _rope_append_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, dlen_ptr, q_out_ptr, dk_ptr, dv_ptr,
                        s_dk_h, s_dk_n, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr):
    i = tl.program_id(0)  # head row of the fused projection: q heads, then k heads, then v heads
    dt = qkv_ptr.dtype.element_ty
    cols = tl.arange(0, D)
    x = tl.load(qkv_ptr + i * D + cols)
    n = tl.load(dlen_ptr).to(tl.int64)
    if i < HQ + HKV:
        first = cols < D // 2
        xr = tl.load(qkv_ptr + i * D + tl.where(first, cols + D // 2, cols - D // 2))
        xr = tl.where(first, -xr, xr)  # rotate_half
        pos = tl.load(pos_ptr).to(tl.int64)
        c = tl.load(cos_ptr + pos * D + cols).to(tl.float32)
        s = tl.load(sin_ptr + pos * D + cols).to(tl.float32)
        a = (x.to(tl.float32) * c).to(dt)
        b = (xr.to(tl.float32) * s).to(dt)
        y = (a.to(tl.float32) + b.to(tl.float32)).to(dt)
        if i < HQ:
            tl.store(q_out_ptr + i * D + cols, y)
        else:
            tl.store(dk_ptr + (i - HQ) * s_dk_h + n * s_dk_n + cols, y)
    else:
        tl.store(dv_ptr + (i - HQ - HKV) * s_dk_h + n * s_dk_n + cols, x)


def rope_append(qkv: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, pos: torch.Tensor,
                dense_len: torch.Tensor, q_out: torch.Tensor, dense_k: torch.Tensor, dense_v: torch.Tensor,
                n_q: int, n_kv: int, head_dim: int) -> torch.Tensor:
    """qkv ((n_q + 2 n_kv) * D,) -> q_out (n_q, D) after RoPE; RoPE'd k and v into dense_k/v[:, dense_len]."""
    assert dense_k.stride() == dense_v.stride() and dense_k.stride(2) == 1 and cos_table.is_contiguous()
    _rope_append_kernel[(n_q + 2 * n_kv,)](qkv, cos_table, sin_table, pos, dense_len, q_out, dense_k, dense_v,
                                           dense_k.stride(0), dense_k.stride(1), HQ=n_q, HKV=n_kv, D=head_dim)
    return q_out


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, N, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    g = tl.load(gu_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + N + cols, mask=ok, other=0.0)
    a = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + cols, (a.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """gate_up (2I,) = [gate | up] -> out (I,) = silu(gate) * up."""
    N = out.numel()
    BLOCK = 1024
    _silu_mul_kernel[(triton.cdiv(N, BLOCK),)](gate_up, out, N, BLOCK=BLOCK)
    return out
