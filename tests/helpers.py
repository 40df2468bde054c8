"""Tiny random speech LLMs built from config, shared by the engine tests."""

import numpy as np
import torch
from transformers import (Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration,
                          VoxtralForConditionalGeneration, WhisperFeatureExtractor)

from wnw_exp.backbones.qwen_omni import QwenOmniBackbone
from wnw_exp.backbones.tiny_random import tiny_voxtral_config
from wnw_exp.backbones.voxtral import VoxtralBackbone
from wnw_exp.backbones.word_tokenizer import EOS, build_word_tokenizer
from wnw_exp.head_scores import HeadScores


def scores_for(vs, hs, name="tiny_test", n_q_heads=None, **calibration) -> HeadScores:
    """Head scores for a made-up model: voice scores `vs` and sensitivities `hs`, both (L, H_kv)."""
    vs, hs = np.asarray(vs, float), np.asarray(hs, float)
    L, H = vs.shape
    return HeadScores(model=name, n_layers=L, n_q_heads=n_q_heads or 2 * H, n_kv_heads=H, head_dim=4,
                      token_rate=12.5, voice_score=vs, head_sensitivity=hs, calibration=calibration)


def noise_audio(seconds: float, seed: int = 0) -> np.ndarray:
    return (np.random.RandomState(seed).randn(int(16000 * seconds)) * 0.1).astype(np.float32)


def tiny_voxtral(seed: int = 0, init: float = 0.2) -> VoxtralBackbone:
    """A 3-layer, 8/4-head Voxtral; a wide init so greedy tokens vary instead of repeating one word."""
    tok = build_word_tokenizer([f"w{i}" for i in range(300)])
    cfg = tiny_voxtral_config(len(tok))
    cfg.text_config.initializer_range = init
    torch.manual_seed(seed)
    model = VoxtralForConditionalGeneration(cfg).eval()
    model.generation_config.eos_token_id = EOS
    return VoxtralBackbone(model, "tiny_test", tokenizer=tok, feature_extractor=WhisperFeatureExtractor(feature_size=80))


QWEN_AUDIO, QWEN_AUDIO_START, QWEN_AUDIO_END, QWEN_EOS = 290, 291, 292, 2


def tiny_qwen_omni(seed: int = 0, init: float = 0.2) -> QwenOmniBackbone:
    """A 2-layer Qwen2.5-Omni thinker with 8 query / 2 KV heads (GQA group 4) and M-RoPE."""
    cfg = Qwen2_5OmniThinkerConfig(
        audio_config=dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
                          d_model=32, output_dim=64, n_window=100, max_source_positions=1500),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[0]),
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[1, 1, 2]),
                         initializer_range=init, eos_token_id=QWEN_EOS, tie_word_embeddings=False),
        audio_token_index=QWEN_AUDIO, audio_start_token_id=QWEN_AUDIO_START, audio_end_token_id=QWEN_AUDIO_END,
        initializer_range=init,
    )
    cfg.vision_start_token_id = 293  # real checkpoints carry it; get_rope_index reads it
    torch.manual_seed(seed)
    model = Qwen2_5OmniThinkerForConditionalGeneration(cfg).eval()
    model.generation_config.eos_token_id = QWEN_EOS
    fe = WhisperFeatureExtractor(feature_size=128)

    def prompt_fn(audio):
        inputs = fe(audio, sampling_rate=16000, return_attention_mask=True, padding="longest", return_tensors="pt")
        n_frames = int(inputs.attention_mask.sum())
        n_tok = ((n_frames - 1) // 2 + 1 - 2) // 2 + 1
        ids = [10, 11, 12, QWEN_AUDIO_START] + [QWEN_AUDIO] * n_tok + [QWEN_AUDIO_END, 13, 14, 15]
        return torch.tensor([ids]), inputs.input_features, inputs.attention_mask

    tok = build_word_tokenizer([f"w{i}" for i in range(300)])
    return QwenOmniBackbone(model, "tiny_qwen_test", prompt_fn=prompt_fn, tokenizer=tok)


def placed_two_layer_sample(policy, store_cls, n_audio: int, retention: float, room_delta: int = 0):
    """`policy` started on a made-up sample of 2 layers x 2 KV heads (4 query heads, head_dim 4) and `n_audio` audio
    tokens in a new `store_cls` store, its prefill written and placed layer by layer from seeded random scores; a
    packed store is then compacted with the policy's recall room + `room_delta` rows. Returns (policy, store)."""
    from wnw_exp.engine.decode import place
    from wnw_exp.kv.packed import PackedAudioKVStore
    from wnw_exp.methods.base import PrefillScores, SampleContext

    cpu = torch.device("cpu")
    ctx = SampleContext(n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=4, token_rate=12.5, n_audio=n_audio,
                        retention=retention, device=cpu)
    store = store_cls(2, 2, 4, n_audio, cpu, torch.float32, dense_capacity=16)
    policy.start(ctx, store)
    torch.manual_seed(0)
    for layer in range(2):
        k = torch.randn(2, n_audio + 3, 4)
        store.write_prefill(layer, k, k + 1, (1, 1 + n_audio))
        place(policy, store, layer, PrefillScores(torch.rand(4, 2, n_audio)))
    if isinstance(store, PackedAudioKVStore):
        store.compact(headroom=policy.recall_headroom + room_delta)
    return policy, store


def resident_positions(store, layer: int, head: int) -> set[int]:
    """The audio positions (layer, KV head) holds on the device, on the reference store or a packed one (2 KV heads)."""
    from wnw_exp.kv.reference import AudioKVStore

    if isinstance(store, AudioKVStore):
        return set(store.heads[layer][head].gpu_pos.tolist())
    return set((store.slot_of[layer * 2 + head] >= 0).nonzero().flatten().tolist())


def interpreted_prefill_in_torch(monkeypatch) -> None:
    """Under Triton's interpreter (CPU tensors, TRITON_INTERPRET=1) a decode test's prefill runs `prefill_layer` in its
    PyTorch kernels: the prefill is not what such a test checks (test_fused_decode checks the Triton prefill layer
    against transformers'), and interpreted it is most of its time (a program per prompt row and launch). Both sides
    of every comparison run the same prefill; on CUDA nothing changes."""
    import functools
    import os

    if os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available():
        import wnw_exp.engine.decode as decode
        from wnw_exp.engine.step import prefill_layer

        monkeypatch.setattr(decode, "prefill_layer", functools.partial(prefill_layer, kernels="torch"))


def needs_triton_interpreter() -> None:
    """Skip a test that runs Triton kernels on CPU tensors where that cannot be done here."""
    import importlib.util
    import os

    import pytest

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (optional `gpu` extra)")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")


def triton_swap_device() -> torch.device:
    """Where a test of WnW's one-launch Triton swap runs: the GPU's Triton where CUDA is present, else Triton's
    interpreter on CPU tensors (skips where neither can run)."""
    import importlib.util

    if torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
        return torch.device("cuda")
    needs_triton_interpreter()
    return torch.device("cpu")


def one_launch_swaps(n_audio: int, n_s: int, n_c: int, top_k: int, delta: int, variants: list[dict], steps: int):
    """WnW's one-launch Triton swap against its host specification (on the GPU where there is one, else in Triton's
    interpreter on the CPU; skips where neither can run): per `variants` item (`ChunkSwap` keyword arguments, e.g.
    max_recalled, locality) a host `ChunkSwap` and a `FusedChunkSwap` of the same settings with records for `steps`
    decisions and its scores buffer, then the `ChunkSwapTables` that decides them all in one launch. Returns (hosts,
    parts: (fused, scores) each, tables)."""
    dev_ = triton_swap_device()
    from wnw_exp.methods.wnw import triage
    from wnw_exp.methods.wnw.triton_swap import ChunkSwapTables, FusedChunkSwap

    hosts, parts = [], []
    for kw in variants:
        hosts.append(triage.ChunkSwap(n_audio, n_s, n_c, top_k, delta, **kw))
        dev = triage.DeviceChunkSwap(n_audio, n_s, n_c, top_k, delta, dev_, **kw)
        records = dict(selected=torch.zeros(steps + 2, dev.n_chunks, dtype=torch.bool, device=dev_),
                       recall=torch.zeros(steps + 2, dev.n_seg, dtype=torch.bool, device=dev_),
                       release=torch.zeros(steps + 2, dev.n_seg, dtype=torch.bool, device=dev_),
                       resident=torch.zeros(steps + 2, dtype=torch.long, device=dev_))
        parts.append((FusedChunkSwap(dev, records, torch.zeros((), dtype=torch.long, device=dev_), n_s, n_c, top_k,
                                     delta), torch.zeros(n_audio, device=dev_)))
    return hosts, parts, ChunkSwapTables(parts, dev_)
