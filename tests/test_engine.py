"""The engine with method=full against transformers' own generate(): same greedy tokens, same logits, on both
backbone families (Voxtral's nested language model, Qwen2.5-Omni's M-RoPE), for the reference path (reference
store and step, what the CPU runs) and the fast path's structure (packed store, fused step; its kernels' PyTorch
equivalents here, Triton's in tests/test_fused_decode.py)."""

import pytest
import torch

from helpers import noise_audio, tiny_qwen_omni, tiny_voxtral
from wnw_exp.engine.serve import generate
from wnw_exp.methods.base import Policy

N_NEW = 48


def hf_generate(backbone, prompt, n_new):
    kwargs = dict(input_ids=prompt.input_ids, attention_mask=torch.ones_like(prompt.input_ids),
                  max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                  output_logits=True, return_dict_in_generate=True)
    kwargs.update(prompt.audio_inputs)
    out = backbone.model.generate(**kwargs)
    return out.sequences[0, prompt.input_ids.shape[1]:].tolist(), out.logits


PATHS = {"reference": dict(store="reference"), "fused": dict(store="packed", fused=True, kernels="torch")}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("build", [tiny_voxtral, tiny_qwen_omni], ids=["voxtral", "qwen_omni"])
def test_full_engine_matches_transformers_generate(build, path):
    backbone = build()
    backbone.eos_token_ids = [-1]  # force N_NEW tokens on both sides (HF gets min_new_tokens)
    prompt = backbone.build_prompt(noise_audio(6.0))
    assert prompt.n_audio > 50
    ours = generate(backbone, prompt, Policy(), retention=1.0, max_new_tokens=N_NEW, keep_logits=True, **PATHS[path])
    ref_tokens, ref_logits = hf_generate(backbone, prompt, N_NEW)
    assert len(ours.tokens) == N_NEW
    assert ours.tokens == ref_tokens
    assert len(set(ref_tokens)) > 5, "the test model must not just repeat one token"
    for a, b in zip(ours.logits, ref_logits):
        assert (a - b[0].float()).abs().max() < 1e-4
    assert ours.store_summary["r_gpu"] == 1.0 and ours.store_summary["r_gpu_cpu"] == 1.0
