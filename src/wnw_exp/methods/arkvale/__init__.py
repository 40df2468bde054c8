"""ArkVale (Chen et al. 2024) on the audio region, in two files: `policy` (the method: pages, digests, budget,
placement and the per-step page swap, on the host and as device tensors) and `kernels` (the per-layer swap of a
CUDA graph in one Triton kernel; imported only where Triton runs)."""

from wnw_exp.methods.arkvale.policy import ArkVale, key_digests, page_scores, page_table

__all__ = ["ArkVale", "key_digests", "page_scores", "page_table"]
