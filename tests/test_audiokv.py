"""AudioKV: the per-head budget, FFT smoothing, and the realised r_GPU."""

import numpy as np
import pytest
import torch

from helpers import noise_audio, tiny_voxtral
from wnw_exp.head_scores import HeadScores
from wnw_exp.engine.serve import generate
from wnw_exp.methods.audiokv import AudioKV, fft_smooth, head_budgets


def test_budget_floor_proportional_share_and_exact_total():
    vs = np.array([[0.0, 1.0], [3.0, 0.0]])
    b = head_budgets(vs, retention=0.2, n_audio=1000, baseline_ratio=0.5)
    assert b.sum() == 800  # 0.2 * 4 heads * 1000
    # floor 0.5 * 200 = 100 each, the other 400 shared 1:3
    assert b.tolist() == [[100, 200], [400, 100]]
    capped = head_budgets(np.array([[0.0, 0.0, 0.0, 10.0]]), retention=0.5, n_audio=100, baseline_ratio=0.2)
    assert capped.sum() == 200 and capped.max() == 100  # the top head is capped, its excess re-shared
    assert sorted(capped[0][:3].tolist()) == [33, 33, 34]
    uniform = head_budgets(np.zeros((2, 3)), retention=0.37, n_audio=101, baseline_ratio=0.5)
    assert uniform.sum() == round(0.37 * 6 * 101) and uniform.max() - uniform.min() <= 1


def test_fft_smoothing():
    x = torch.tensor([0.0, 1.0] * 8 + [5.0] * 4)
    assert torch.allclose(fft_smooth(x, alpha=0.0, rho=0.3), x)
    assert torch.allclose(fft_smooth(x, alpha=0.7, rho=1.0), x, atol=1e-6)
    const = torch.full((10,), 2.0)
    assert torch.allclose(fft_smooth(const, 0.5, 0.1), const)
    alt = torch.tensor([0.0, 1.0] * 10)  # only the Nyquist bin and DC: a low-pass keeps the mean
    assert torch.allclose(fft_smooth(alt, alpha=1.0, rho=0.5), torch.full((20,), 0.5), atol=1e-6)
    assert torch.allclose(fft_smooth(alt, alpha=0.5, rho=0.5), 0.5 * alt + 0.25, atol=1e-6)


@pytest.mark.parametrize("retention", [0.2, 0.6])
def test_audiokv_keeps_its_budget_and_drops_the_rest(retention):
    backbone = tiny_voxtral()
    vs = np.random.RandomState(0).rand(backbone.n_layers, backbone.n_kv_heads)
    scores = HeadScores(model="tiny_test", n_layers=3, n_q_heads=8, n_kv_heads=4, head_dim=16, token_rate=12.5,
                        voice_score=vs, head_sensitivity=np.ones_like(vs))
    policy = AudioKV(scores=scores, backbone_info=backbone.describe())
    res = generate(backbone, backbone.build_prompt(noise_audio(5.0)), policy, retention=retention, max_new_tokens=6)
    n_audio = res.trace["n_audio"]
    assert res.store_summary["r_gpu"] == pytest.approx(round(retention * 12 * n_audio) / (12 * n_audio))
    assert res.store_summary["r_gpu_cpu"] == res.store_summary["r_gpu"]  # no CPU tier
    assert policy.budget.sum() == round(retention * 12 * n_audio)
