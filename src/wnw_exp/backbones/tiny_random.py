"""`model=tiny_random`: a tiny Voxtral-architecture model with random weights, built from config.

It needs no files, so every command and test runs offline; its transcripts are gibberish by design.
"""

from __future__ import annotations

import torch
from transformers import VoxtralConfig, VoxtralForConditionalGeneration, WhisperFeatureExtractor

from wnw_exp.backbones.voxtral import VoxtralBackbone
from wnw_exp.backbones.word_tokenizer import AUDIO, EOS, build_word_tokenizer


def tiny_voxtral_config(vocab_size: int, *, layers: int = 3, q_heads: int = 8, kv_heads: int = 4,
                        head_dim: int = 16, hidden: int = 64, audio_hidden: int = 32, mel_bins: int = 80) -> VoxtralConfig:
    return VoxtralConfig(
        audio_config=dict(hidden_size=audio_hidden, intermediate_size=4 * audio_hidden, num_hidden_layers=2,
                          num_attention_heads=2, num_mel_bins=mel_bins, max_source_positions=1500),
        text_config=dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=q_heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, max_position_embeddings=16384, rope_theta=10000.0,
                         bos_token_id=1, eos_token_id=EOS, pad_token_id=8),
        audio_token_id=AUDIO,
    )


def build_tiny_random(cfg: dict) -> VoxtralBackbone:
    from wnw_exp.vocabulary import DEFAULT_VOCAB_SIZE, vocabulary

    tokenizer = build_word_tokenizer(vocabulary("en", int(cfg.get("vocab_size") or DEFAULT_VOCAB_SIZE)))
    config = tiny_voxtral_config(len(tokenizer), layers=cfg.get("layers", 3), q_heads=cfg.get("q_heads", 8),
                                 kv_heads=cfg.get("kv_heads", 4), head_dim=cfg.get("head_dim", 16))
    with torch.random.fork_rng():
        torch.manual_seed(int(cfg.get("seed", 0)))
        model = VoxtralForConditionalGeneration(config)
    model.generation_config.eos_token_id = EOS
    fe = WhisperFeatureExtractor(feature_size=config.audio_config.num_mel_bins)
    return VoxtralBackbone(model, cfg["name"], tokenizer=tokenizer, feature_extractor=fe)
