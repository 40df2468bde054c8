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
- `rope_split`: the prefill's RoPE over a whole prompt, from one q|k|v projection into the attention's head-major
  q, k and v (the fused prefill layer, `engine.step.prefill_layer`).
The torch equivalents are in `engine/step.py` (`*_torch`), the specification these are tested against.
Import this module only where `triton` is installed; on a CPU set TRITON_INTERPRET=1 before importing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rmsnorm_kernel(h_ptr, d_ptr, w_ptr, out_ptr, N, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * N  # one program per row (a batch of streams: one row each)
    h_ptr, d_ptr, out_ptr = h_ptr + r, d_ptr + r, out_ptr + r
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
    """hidden (N,) or (B, N) += delta (in place, when given); out = RMSNorm(hidden) * weight, row by row."""
    N = hidden.shape[-1]
    _add_rmsnorm_kernel[(hidden.numel() // N,)](hidden, delta if delta is not None else hidden, weight, out, N, eps,
                              HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(N), num_warps=8)
    return out


@triton.jit
def _rope_row(head_ptr, x, cos_row, sin_row, cols, D: tl.constexpr):
    """One head row `x` (loaded from `head_ptr`; or a block of rows: pointers (BT, 1), cols (1, D)) after RoPE,
    in its dtype, rounded where HF's `x * cos + rotate_half(x) * sin` rounds (the append and split kernels)."""
    dt = head_ptr.dtype.element_ty
    first = cols < D // 2
    xr = tl.load(head_ptr + tl.where(first, cols + D // 2, cols - D // 2))
    xr = tl.where(first, -xr, xr)  # rotate_half
    c = tl.load(cos_row + cols).to(tl.float32)
    s = tl.load(sin_row + cols).to(tl.float32)
    a = (x.to(tl.float32) * c).to(dt)
    b = (xr.to(tl.float32) * s).to(dt)
    return (a.to(tl.float32) + b.to(tl.float32)).to(dt)


@triton.jit
def _rope_append_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, dlen_ptr, q_out_ptr, dk_ptr, dv_ptr,
                        s_dk_h, s_dk_n, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr):
    i = tl.program_id(0)  # head row of the fused projection: q heads, then k heads, then v heads
    cols = tl.arange(0, D)
    x = tl.load(qkv_ptr + i * D + cols)
    n = tl.load(dlen_ptr).to(tl.int64)
    if i < HQ + HKV:
        pos = tl.load(pos_ptr).to(tl.int64)
        y = _rope_row(qkv_ptr + i * D, x, cos_ptr + pos * D, sin_ptr + pos * D, cols, D)
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
def _rope_split_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, T, HQ: tl.constexpr, HKV: tl.constexpr,
                       D: tl.constexpr, BT: tl.constexpr):
    j = tl.program_id(0)  # the head row of the fused projection: q heads, then k heads, then v heads
    t = tl.program_id(1).to(tl.int64) * BT + tl.arange(0, BT)[:, None]  # a block of prompt rows, (BT, 1)
    ok = t < T
    t = tl.minimum(t, T - 1)  # rows past the prompt read its last row and store nothing
    cols = tl.arange(0, D)[None, :]
    src = qkv_ptr + (t * (HQ + 2 * HKV) + j) * D
    x = tl.load(src + cols)
    if j < HQ + HKV:
        y = _rope_row(src, x, cos_ptr + t * D, sin_ptr + t * D, cols, D)
        if j < HQ:
            tl.store(q_ptr + (j * T + t) * D + cols, y, mask=ok)
        else:
            tl.store(k_ptr + ((j - HQ) * T + t) * D + cols, y, mask=ok)
    else:
        tl.store(v_ptr + ((j - HQ - HKV) * T + t) * D + cols, x, mask=ok)


def rope_split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, n_q: int, n_kv: int, head_dim: int) -> None:
    """A prompt's qkv (T, (n_q + 2 n_kv) * D) -> q (n_q, T, D) and k (n_kv, T, D) after RoPE at row t's cos/sin
    (T, D), v (n_kv, T, D) as it is; one program per head and block of 16 rows."""
    T = qkv.shape[0]
    assert qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    bt = 16
    _rope_split_kernel[(n_q + 2 * n_kv, triton.cdiv(T, bt))](qkv, cos, sin, q, k, v, T, HQ=n_q, HKV=n_kv,
                                                             D=head_dim, BT=bt)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, N, BLOCK: tl.constexpr):
    r = tl.program_id(1).to(tl.int64)  # the row (stream) of a batch
    gu_ptr, out_ptr = gu_ptr + r * 2 * N, out_ptr + r * N
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    g = tl.load(gu_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + N + cols, mask=ok, other=0.0)
    a = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + cols, (a.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """gate_up (2I,) = [gate | up] -> out (I,) = silu(gate) * up; (B, 2I) -> (B, I) row by row."""
    N = out.shape[-1]
    BLOCK = 1024
    _silu_mul_kernel[(triton.cdiv(N, BLOCK), out.numel() // N)](gate_up, out, N, BLOCK=BLOCK)
    return out


@triton.jit
def _rope_append_batched_kernel(qkv_ptr, cos_ptr, sin_ptr, t_ptr, dlen_ptr, bt_ptr, q_out_ptr, k_ptr, v_ptr,
                                T, N_PAGES, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                                PAGE: tl.constexpr):
    i = tl.program_id(0)  # stream b's head row j of the fused projection: q heads, then k heads, then v heads
    b = i // (HQ + 2 * HKV)
    j = i % (HQ + 2 * HKV)
    cols = tl.arange(0, D)
    x = tl.load(qkv_ptr + i.to(tl.int64) * D + cols)
    n = tl.load(dlen_ptr + b).to(tl.int64)
    ok = n >= 0  # (dense length -1: a padding row of a batch, whose k and v go nowhere)
    if j < HQ + HKV:
        row = b.to(tl.int64) * T + tl.load(t_ptr + b).to(tl.int64)  # stream b's RoPE table row of this step
        y = _rope_row(qkv_ptr + i.to(tl.int64) * D, x, cos_ptr + row * D, sin_ptr + row * D, cols, D)
        if j < HQ:
            tl.store(q_out_ptr + (b.to(tl.int64) * HQ + j) * D + cols, y)
        else:
            bt = bt_ptr + (b * HKV + (j - HQ)).to(tl.int64) * N_PAGES
            dst = tl.load(bt + n // PAGE, mask=ok, other=0).to(tl.int64) + n % PAGE
            tl.store(k_ptr + dst * D + cols, y, mask=ok & (cols < D))
    else:
        bt = bt_ptr + (b * HKV + (j - HQ - HKV)).to(tl.int64) * N_PAGES
        dst = tl.load(bt + n // PAGE, mask=ok, other=0).to(tl.int64) + n % PAGE
        tl.store(v_ptr + dst * D + cols, x, mask=ok & (cols < D))


def rope_append_batched(qkv: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, t: torch.Tensor,
                        dense_len: torch.Tensor, dense_table: torch.Tensor, q_out: torch.Tensor, pool_k: torch.Tensor,
                        pool_v: torch.Tensor, n_q: int, n_kv: int, head_dim: int, *, page_rows: int) -> torch.Tensor:
    """B streams: qkv (B, (n_q + 2 n_kv) * D) -> q_out (B, n_q, D) after RoPE (stream b at row t[b] of its table,
    cos_table (B, T, D)); RoPE'd k and v into the pool at stream b's dense token n = dense_len[b], through its
    page table: row dense_table[b, h, n // page_rows] + n % page_rows (dense_table (B, n_kv, pages) int32); a row
    with dense_len -1 (padding) writes no k or v."""
    B = qkv.shape[0]
    assert cos_table.is_contiguous() and sin_table.is_contiguous() and dense_table.is_contiguous()
    _rope_append_batched_kernel[(B * (n_q + 2 * n_kv),)](qkv, cos_table, sin_table, t, dense_len, dense_table, q_out,
                                                         pool_k, pool_v, cos_table.shape[1], dense_table.shape[2],
                                                         HQ=n_q, HKV=n_kv, D=head_dim, PAGE=int(page_rows))
    return q_out


@triton.jit
def _row_scores(q, kt, scale, PRECISION: tl.constexpr):
    """Scores (BM, BN), fp32, of a block of query rows q (BM, D) against a block of keys kt (D, BN), times `scale`:
    `tl.dot` at `kv.triton_attention.dot_precision`, or ("fma", head_dim < 16) products summed in fp32."""
    if PRECISION == "fma":
        return tl.sum(q.to(tl.float32)[:, :, None] * kt.to(tl.float32)[None, :, :], axis=1) * scale
    return tl.dot(q, kt, input_precision=PRECISION).to(tl.float32) * scale


@triton.jit
def _prefill_probs_kernel(q_ptr, k_ptr, out_ptr, T, first, a0, NA, R, scale, GROUP: tl.constexpr, D: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr):
    h = tl.program_id(0)  # query head; it reads KV head h // GROUP
    r = tl.program_id(1) * BM + tl.arange(0, BM)  # output rows: prompt rows first + r
    t = first + r
    ok = r < R
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (h * T + t[:, None]).to(tl.int64) * D + d[None, :], mask=ok[:, None], other=0.0)
    kb = k_ptr + ((h // GROUP) * T).to(tl.int64) * D
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    seen = tl.minimum(first + tl.program_id(1) * BM + BM, T)  # keys the block's last row sees, causal
    for n0 in range(0, seen, BN):  # pass 1: each row's softmax maximum and sum over every key it sees
        n = n0 + tl.arange(0, BN)
        kt = tl.load(kb + n[None, :].to(tl.int64) * D + d[:, None], mask=n[None, :] < T, other=0.0)
        s = tl.where(n[None, :] <= t[:, None], _row_scores(q, kt, scale, PRECISION), float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m = m_new
    out = out_ptr + (h * R + r[:, None]).to(tl.int64) * NA
    for c0 in range(0, NA, BN):  # pass 2: the weights at the audio keys a0 .. a0 + NA - 1
        c = c0 + tl.arange(0, BN)
        n = a0 + c
        kt = tl.load(kb + n[None, :].to(tl.int64) * D + d[:, None], mask=c[None, :] < NA, other=0.0)
        s = _row_scores(q, kt, scale, PRECISION)
        p = tl.where(n[None, :] <= t[:, None], tl.exp(s - m[:, None]) / l[:, None], 0.0)
        tl.store(out + c[None, :], p, mask=ok[:, None] & (c[None, :] < NA))


def prefill_probs(q: torch.Tensor, k: torch.Tensor, span: tuple[int, int], scale: float,
                  first_row: int) -> torch.Tensor:
    """`engine.decode._probs_to_audio` in one launch: the softmax weights (H_q, T - first_row, n_audio), fp32, of
    prompt rows first_row.. over every key each row sees (causal), at the audio keys span[0] .. span[1] - 1; q
    (H_q, T, D), k (H_kv, T, D) after RoPE, query head h reading KV head h // (H_q / H_kv). One program per query
    head and block of 16 rows, two passes over the keys (an online softmax's maximum and sum, then the weights), the
    products accumulated in fp32 as the PyTorch version's fp32 matmul (no full fp32 copy of the keys, no (rows, T)
    score matrix)."""
    from wnw_exp.kv.triton_attention import dot_precision

    n_q, T, D = q.shape
    s, e = span
    R = T - first_row
    out = torch.empty(n_q, max(R, 0), e - s, device=q.device, dtype=torch.float32)
    if R <= 0 or e == s:
        return out
    q, k = q.contiguous(), k.contiguous()
    bm, bn = 16, 64
    _prefill_probs_kernel[(n_q, triton.cdiv(R, bm))](q, k, out, T, first_row, s, e - s, R, float(scale),
                                                     GROUP=n_q // k.shape[0], D=D, BM=bm, BN=bn,
                                                     PRECISION=dot_precision(q.dtype, D))
    return out
