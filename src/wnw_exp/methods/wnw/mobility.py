"""WnW's calibration hook: the swap mobility `method.mobility: auto` reads, measured by `wnw-calibrate`."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from tqdm import tqdm

from wnw_exp.methods.wnw import triage


def measure_swap_mobility(policy: Any, prompts: list[tuple[Any, float]], decode: Callable[..., Any],
                          retention: float = 0.2, progress: bool = False) -> dict:
    """The mobility constant of WnW's recall estimate (`triage.expected_resident_segments`), measured.

    The prompts (with their audio durations) are decoded greedily by the engine (`decode(policy, prompt,
    retention, seconds)`) with `policy`, a WnW at `mobility: auto` (default triage and chunk swap settings; lambda
    solved as a run solves it, with the default mobility since the head scores have no measurement yet), at
    `retention`. For each sample the number of recalled segments, averaged over decode steps, is mapped back to a
    mobility through the sample's own bounds (`triage.mobility_of`); the value is the mean over samples. WnW's
    `lam: auto` then charges each sample the recall this mobility predicts for its length, so that the measured
    r_GPU, not only the prefill one, matches the target (§3.4 chooses lambda "so that the measured r_GPU matches
    each target" on the calibration set).
    """
    per_sample, resident, r_gpu, expected = [], [], [], []
    for prompt, duration in tqdm(prompts, desc="swap mobility", disable=not progress, unit="sample"):
        res = decode(policy, prompt, retention, duration)
        counts = res.trace["wnw"]["resident_segments"]
        if not counts:
            continue
        mu = triage.mobility_of(float(np.mean(counts)), prompt.n_audio, policy.n_s, policy.n_c, policy.top_k,
                                policy.delta)
        if mu is None:
            continue
        per_sample.append(mu)
        resident.append(float(np.mean(counts)))
        r_gpu.append(res.store_summary["r_gpu"])
        expected.append(policy.expected_r_gpu)
    mean = lambda xs: float(np.mean(xs)) if xs else None  # noqa: E731
    return dict(value=mean(per_sample), n_samples=len(per_sample), per_sample=per_sample,
                mean_resident_segments=resident, retention=retention, n_anchor=policy.n_anchor,
                prior=policy.mobility, measured_r_gpu=mean(r_gpu), expected_r_gpu=mean(expected), signal="vs_hs",
                **triage.DEFAULT_SWAP)
