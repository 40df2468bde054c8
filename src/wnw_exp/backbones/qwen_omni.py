"""Qwen2.5-Omni adapter (thinker only): Whisper-style encoder at 25 tokens/s and a Qwen2 decoder with M-RoPE.

Position ids are the model's own 3-D M-RoPE ids (`get_rope_index`); for audio-only prompts the three
components coincide, and generated tokens continue at `max + 1 + n` in all three.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import Qwen2_5OmniThinkerForConditionalGeneration

from wnw_exp.backbones.base import Backbone, Prompt, contiguous_span
from wnw_exp.data.base import SAMPLE_RATE

SYSTEM_PROMPT = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving auditory and "
    "visual inputs, as well as generating text and speech."
)
LANGUAGE_NAMES = {"en": "English", "fr": "French", "de": "German", "es": "Spanish", "zh": "Chinese"}


def asr_instruction(language: str | None) -> str:
    """The official Qwen2.5-Omni ASR instruction."""
    lang = LANGUAGE_NAMES.get(language or "en", language or "English")
    return f"Transcribe the {lang} audio into text without any punctuation marks."


def translation_instruction(language: str | None, target: str) -> str:
    src = LANGUAGE_NAMES.get(language or "en", language)
    return f"Translate the {src} audio into {LANGUAGE_NAMES.get(target, target)} text."


class QwenOmniBackbone(Backbone):
    def __init__(self, model: Qwen2_5OmniThinkerForConditionalGeneration, name: str, *, processor=None,
                 prompt_fn=None, tokenizer=None):
        """`processor` builds prompts for real checkpoints; `prompt_fn(audio) -> (input_ids, features, mask)`
        replaces it for models without a tokenizer of their own (tests)."""
        self.name, self.model, self.processor, self.prompt_fn = name, model.eval(), processor, prompt_fn
        self.tokenizer = tokenizer if tokenizer is not None else getattr(processor, "tokenizer", None)
        # transformers <= 5.17 holds the text model at `model.model`; later releases at
        # `model.model.language_model` (the thinker gained a base model wrapping all towers).
        lm, cfg = getattr(model.model, "language_model", model.model), model.config.text_config
        self.layers, self.final_norm, self.rotary, self.embed_tokens = lm.layers, lm.norm, lm.rotary_emb, lm.embed_tokens
        if any(getattr(layer.self_attn, "sliding_window", None) for layer in self.layers):
            raise ValueError("sliding-window attention layers are not supported by the engine")
        self.lm_head = model.lm_head
        self.n_layers, self.n_q_heads, self.n_kv_heads = (
            cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_positions = cfg.max_position_embeddings
        self.token_rate = 25.0  # 100 mel frames/s, conv stride 2, then 2x pooling
        self.audio_token_id = model.config.audio_token_id
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        self.eos_token_ids = list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]

    def build_prompt(self, audio, task="transcribe", language="en", target_language=None) -> Prompt:
        audio = np.asarray(audio, dtype=np.float32)
        if self.prompt_fn is not None:
            ids, feats, mask = self.prompt_fn(audio)
        else:
            text = translation_instruction(language, target_language or "fr") if task == "translate" else asr_instruction(language)
            conversation = [
                {"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]},
                {"role": "user", "content": [{"type": "audio", "audio": audio}, {"type": "text", "text": text}]},
            ]
            prompt_text = self.processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
            # truncation=False: the processor would otherwise cut audio longer than 300 s.
            inputs = self.processor(text=prompt_text, audio=[audio], sampling_rate=SAMPLE_RATE, return_tensors="pt",
                                    padding=True, truncation=False)
            ids, feats, mask = inputs["input_ids"], inputs["input_features"], inputs["feature_attention_mask"]
        return Prompt(ids, contiguous_span(ids, self.audio_token_id),
                      {"input_features": feats, "feature_attention_mask": mask})

    @torch.no_grad()
    def embed_prompt(self, prompt: Prompt) -> torch.Tensor:
        ids = prompt.input_ids.to(self.device)
        embeds = self.embed_tokens(ids)
        feats = prompt.audio_inputs["input_features"].to(self.device, self.dtype)
        mask = prompt.audio_inputs["feature_attention_mask"].to(self.device)
        audio = self.model.get_audio_features(feats, feature_attention_mask=mask).last_hidden_state
        return self.place_audio(embeds, audio, prompt)

    def prompt_positions(self, prompt: Prompt) -> torch.Tensor:
        ids = prompt.input_ids.to(self.device)
        mask = prompt.audio_inputs["feature_attention_mask"].to(self.device)
        pos, _ = self.model.get_rope_index(ids, None, None, torch.ones_like(ids), False, mask.sum(-1), None)
        return pos  # (3, 1, T)

    def next_positions(self, prompt_positions, n_done, n_new=1):
        start = int(prompt_positions.max()) + 1 + n_done
        return torch.arange(start, start + n_new, device=self.device).view(1, 1, -1).expand(3, 1, -1)

    def decode(self, token_ids):
        return self.tokenizer.decode(token_ids, skip_special_tokens=True).strip()
