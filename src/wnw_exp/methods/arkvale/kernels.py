"""ArkVale's step 5 decision for one layer in one Triton kernel (one program per KV head), for the packed store's
Triton path inside a CUDA graph: what `ArkVale.swap_pages` does in many small PyTorch kernels.

Per head: page scores (sum_d max(q_d hi_d, q_d lo_d), the mean over the head's query group, in float32), the top-k
pages by score (ties: the lower page), the missing ones (top-k, not resident) and as many victims (resident, not in
the top-k, the lowest scores; ties: the lower page); the resident-page mask is updated in place and the decision is
written as data, one code per (head, page): 1 missing, 2 victim, 0 neither. The store queues the positions of those
pages (`PackedAudioKVStore.queue_pages`) and its flush of the layer moves them; this kernel touches no store. Ranks
are counted pairwise (page p's rank = the pages ahead of it), exact for any tie.
Import this module only where `triton` is installed; on a CPU set TRITON_INTERPRET=1 before importing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_P = 32  # pages per score / rank tile


@triton.jit
def _swap_kernel(q_ptr, hi_ptr, lo_ptr, scores_ptr, codes_ptr, res_ptr, k_ptr, budget_ptr, recalled_ptr, P,
                 G: tl.constexpr, D: tl.constexpr, P_PAD: tl.constexpr, GIVEN: tl.constexpr, BLOCK_P: tl.constexpr):
    h = tl.program_id(0)
    cols = tl.arange(0, D)
    lanes = tl.arange(0, BLOCK_P)
    # 1. page scores into this head's scratch row (GIVEN: the caller wrote them)
    if not GIVEN:
        for p0 in range(0, P, BLOCK_P):
            pg = p0 + lanes
            pm = pg < P
            at = (h * P + pg).to(tl.int64)[:, None] * D + cols[None, :]
            hi = tl.load(hi_ptr + at, mask=pm[:, None], other=0.0).to(tl.float32)
            lo = tl.load(lo_ptr + at, mask=pm[:, None], other=0.0).to(tl.float32)
            acc = tl.zeros([BLOCK_P], tl.float32)
            for g in range(G):
                q = tl.load(q_ptr + (h * G + g) * D + cols).to(tl.float32)
                acc += tl.sum(tl.maximum(q[None, :] * hi, q[None, :] * lo), axis=1)
            tl.store(scores_ptr + h * P_PAD + pg, acc / G, mask=pm)
        tl.debug_barrier()
    pages = tl.arange(0, P_PAD)
    valid = pages < P
    s = tl.load(scores_ptr + h * P_PAD + pages, mask=valid, other=0.0)
    res = valid & (tl.load(res_ptr + h * P + pages, mask=valid, other=0) != 0)
    k = tl.load(k_ptr + h)
    active = tl.load(budget_ptr + h) > 0
    # 2. the top-k: page p's rank = the pages with a higher score, or an equal one and a lower index
    ahead = tl.zeros([P_PAD], tl.int32)
    for q0 in range(0, P, BLOCK_P):
        qi = q0 + lanes
        qm = qi < P
        sq = tl.load(scores_ptr + h * P_PAD + qi, mask=qm, other=0.0)
        before = (sq[None, :] > s[:, None]) | ((sq[None, :] == s[:, None]) & (qi[None, :] < pages[:, None]))
        ahead += tl.sum((before & qm[None, :]).to(tl.int32), axis=1)
    top = valid & (ahead < k)
    missing = top & ~res & active
    n_missing = tl.sum(missing.to(tl.int32), axis=0)
    cand = res & ~top
    tl.store(codes_ptr + h * P_PAD + pages, cand.to(tl.int8), mask=valid)
    tl.debug_barrier()
    # 3. the victims: the n_missing candidates with the lowest scores (ties: the lower page)
    below = tl.zeros([P_PAD], tl.int32)
    for q0 in range(0, P, BLOCK_P):
        qi = q0 + lanes
        qm = qi < P
        sq = tl.load(scores_ptr + h * P_PAD + qi, mask=qm, other=0.0)
        cq = qm & (tl.load(codes_ptr + h * P_PAD + qi, mask=qm, other=0) != 0)
        lower = (sq[None, :] < s[:, None]) | ((sq[None, :] == s[:, None]) & (qi[None, :] < pages[:, None]))
        below += tl.sum((lower & cq[None, :]).to(tl.int32), axis=1)
    victims = cand & (below < n_missing)
    tl.debug_barrier()
    tl.store(res_ptr + h * P + pages, ((res & ~victims) | missing).to(tl.int8), mask=valid)
    tl.store(codes_ptr + h * P_PAD + pages, tl.where(missing, 1, tl.where(victims, 2, 0)).to(tl.int8), mask=valid)
    tl.atomic_add(recalled_ptr, n_missing.to(tl.int64))


def swap(q: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, resident: torch.Tensor, k: torch.Tensor,
         budget: torch.Tensor, recalled: torch.Tensor, scratch: dict, scores: torch.Tensor | None = None) -> torch.Tensor:
    """ArkVale's swap of one layer: q (H_q, D) the step's query, hi/lo (H, P, D) the digests, resident (H, P) bool
    (updated in place), k and budget (H,) int64, `recalled` an int64 counter of recalled pages. Returns the codes
    (H, P_PAD) int8 (1 missing, 2 victim; the same tensor every call, for `PackedAudioKVStore.queue_pages`).
    `scores` (H, P) float32, when given, replaces the kernel's own page scores (tests)."""
    H, P, D = hi.shape
    G = q.shape[0] // H
    P_PAD = max(BLOCK_P, triton.next_power_of_2(P))
    if scratch.get("shape") != (H, P_PAD):
        scratch.update(shape=(H, P_PAD), scores=torch.empty(H, P_PAD, device=q.device, dtype=torch.float32),
                       codes=torch.empty(H, P_PAD, device=q.device, dtype=torch.int8))
    if scores is not None:
        scratch["scores"][:, :P] = scores
    assert q.is_contiguous() and hi.is_contiguous() and lo.is_contiguous() and resident.is_contiguous()
    _swap_kernel[(H,)](q, hi, lo, scratch["scores"], scratch["codes"], resident.view(torch.int8), k, budget, recalled,
                       P, G=G, D=D, P_PAD=P_PAD, GIVEN=scores is not None, BLOCK_P=BLOCK_P)
    return scratch["codes"]
