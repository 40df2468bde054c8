"""Voxtral adapter: Voxtral-Mini-3B / Voxtral-Small-24B, and our own small Voxtral-architecture models.

All of them are `VoxtralForConditionalGeneration`: a Whisper encoder over 30 s windows, a projector that
stacks 4 encoder frames into one audio token (12.5 tokens/s) and a Llama decoder. Three ways to prompt:
the Mistral processor (real Voxtral checkpoints), a tokenizer with a chat template and an audio
placeholder token (`whisper_smollm2`), or the word tokenizer's Voxtral-style prompt (`tiny_random`).
"""

from __future__ import annotations

import base64
import io

import numpy as np
import soundfile as sf
import torch
from transformers import VoxtralForConditionalGeneration, WhisperFeatureExtractor

from wnw_exp.backbones.audio_windows import windowed_features
from wnw_exp.backbones.base import Backbone, Prompt, contiguous_span
from wnw_exp.backbones.word_tokenizer import AUDIO, transcription_prompt
from wnw_exp.data.base import SAMPLE_RATE

# Before the audio: SmolLM2 copies what follows "Repeat exactly:" (measured: with the transcript's own token
# embeddings in place of the audio it copies a 319-word passage at 56% WER, where "Transcribe the audio."
# after it gives 99%: the model writes something else).
CHAT_INSTRUCTION = "Repeat exactly: "
TRANSLATE_INSTRUCTION = {"fr": "French", "en": "English", "de": "German", "es": "Spanish"}


def chat_prompt_ids(tokenizer, audio_token_id: int, n_audio_tokens: int) -> list[int]:
    """The tokenizer's chat template around one user turn, CHAT_INSTRUCTION then `n_audio_tokens` audio
    placeholders, with the assistant's turn opened; the answer follows, then the template's end token."""
    marker = tokenizer.convert_ids_to_tokens(audio_token_id)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": f"{CHAT_INSTRUCTION}{marker}"}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    at = ids.index(audio_token_id)
    return ids[:at] + [audio_token_id] * n_audio_tokens + ids[at + 1:]


class VoxtralBackbone(Backbone):
    """Prompting through the Mistral processor (real checkpoints), a chat template (whisper_smollm2) or a word
    tokenizer (tiny_random)."""

    def __init__(self, model: VoxtralForConditionalGeneration, name: str, *, processor=None, model_id: str | None = None,
                 tokenizer=None, feature_extractor: WhisperFeatureExtractor | None = None):
        if processor is None and (tokenizer is None or feature_extractor is None):
            raise ValueError("VoxtralBackbone needs a processor, or a word tokenizer and a feature extractor")
        self.name = name
        self.model = model.eval()
        self.processor, self.model_id = processor, model_id
        self.tokenizer = tokenizer if tokenizer is not None else processor.tokenizer
        self.feature_extractor = feature_extractor
        lm = model.model.language_model
        cfg = model.config.text_config
        self.layers, self.final_norm, self.rotary, self.embed_tokens = lm.layers, lm.norm, lm.rotary_emb, lm.embed_tokens
        self.lm_head = model.lm_head
        self.n_layers = cfg.num_hidden_layers
        self.n_q_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_positions = cfg.max_position_embeddings
        # 30 s of audio -> 1500 encoder positions -> /(intermediate/hidden) stacked frames per token.
        stack = model.config.audio_config.intermediate_size // model.config.audio_config.hidden_size
        self.token_rate = model.config.audio_config.max_source_positions / stack / 30.0
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        self.eos_token_ids = list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]
        self.audio_token_id = model.config.audio_token_id
        # A tokenizer with a chat template and the audio placeholder among its tokens prompts through the template.
        self.chat = (processor is None and getattr(self.tokenizer, "chat_template", None) is not None
                     and self.tokenizer.convert_ids_to_tokens(self.audio_token_id) is not None)

    def audio_tokens_for(self, seconds: float) -> int:
        # The processor pads to whole 30 s windows.
        return max(1, int(np.ceil(seconds / 30.0))) * round(self.token_rate * 30)

    # --- prompts --------------------------------------------------------------------------------
    def build_prompt(self, audio, task="transcribe", language="en", target_language=None) -> Prompt:
        if self.processor is None:
            return self._chat_prompt(audio, task) if self.chat else self._word_prompt(audio, task)
        if task == "translate":
            inputs = self._translation_inputs(audio, target_language or "fr")
        else:
            # Keyword arguments only: the positional order changed between transformers 4.x and 5.x.
            inputs = self.processor.apply_transcription_request(
                audio=[np.asarray(audio, dtype=np.float32)], model_id=self.model_id, language=language,
                sampling_rate=SAMPLE_RATE, format=["wav"], return_tensors="pt", tokenize=True, return_dict=True,
            )
        ids = inputs["input_ids"][:, :]
        return Prompt(ids, contiguous_span(ids, self.audio_token_id), {"input_features": inputs["input_features"]})

    def _translation_inputs(self, audio, target_language: str):
        buf = io.BytesIO()
        sf.write(buf, np.asarray(audio, dtype=np.float32), SAMPLE_RATE, format="WAV")
        target = TRANSLATE_INSTRUCTION.get(target_language, target_language)
        conversation = [{"role": "user", "content": [
            {"type": "audio", "base64": base64.b64encode(buf.getvalue()).decode()},
            {"type": "text", "text": f"Translate this audio into {target}."},
        ]}]
        return self.processor.apply_chat_template(conversation, tokenize=True, return_dict=True, return_tensors="pt")

    def _word_prompt(self, audio, task) -> Prompt:
        if task != "transcribe":
            raise ValueError(f"model {self.name} only transcribes (task={task!r}); use a Voxtral checkpoint")
        feats = windowed_features(np.asarray(audio, dtype=np.float32), self.feature_extractor)
        n_tokens = feats.shape[0] * round(self.token_rate * 30)
        ids = torch.tensor([transcription_prompt(n_tokens)])
        return Prompt(ids, contiguous_span(ids, AUDIO), {"input_features": feats})

    def _chat_prompt(self, audio, task) -> Prompt:
        if task != "transcribe":
            raise ValueError(f"model {self.name} only transcribes (task={task!r}); use a Voxtral checkpoint")
        feats = windowed_features(np.asarray(audio, dtype=np.float32), self.feature_extractor)
        n_tokens = feats.shape[0] * round(self.token_rate * 30)
        ids = torch.tensor([chat_prompt_ids(self.tokenizer, self.audio_token_id, n_tokens)])
        return Prompt(ids, contiguous_span(ids, self.audio_token_id), {"input_features": feats})

    # --- embeddings and positions ----------------------------------------------------------------
    @torch.no_grad()
    def embed_prompt(self, prompt: Prompt) -> torch.Tensor:
        ids = prompt.input_ids.to(self.device)
        embeds = self.embed_tokens(ids)
        feats = prompt.audio_inputs["input_features"].to(self.device, self.dtype)
        audio = self.model.get_audio_features(feats).pooler_output
        return self.place_audio(embeds, audio, prompt)

    def prompt_positions(self, prompt: Prompt) -> torch.Tensor:
        return torch.arange(prompt.input_ids.shape[1], device=self.device)[None]

    def next_positions(self, prompt_positions, n_done, n_new=1):
        start = int(prompt_positions.max()) + 1 + n_done
        return torch.arange(start, start + n_new, device=self.device)[None]

    def decode(self, token_ids):
        return self.tokenizer.decode(token_ids, skip_special_tokens=True).strip()
