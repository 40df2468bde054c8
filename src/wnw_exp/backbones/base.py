"""What every backbone adapter gives the engine: a prompt with its audio span, and the decoder's parts.

The engine never calls the HF model's forward; it runs these modules layer by layer so every method
gets the same hook points and explicit position ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn


class WeightsNotFoundError(FileNotFoundError):
    """Raised (fast) when a model's weights are neither in `model.path` nor in the local hub cache."""


@dataclass
class Prompt:
    input_ids: torch.Tensor  # (1, T) long
    audio_span: tuple[int, int]  # [start, end) of the audio placeholder tokens in input_ids
    audio_inputs: dict = field(default_factory=dict)  # model-specific tensors that embed the audio

    @property
    def n_audio(self) -> int:
        return self.audio_span[1] - self.audio_span[0]


def contiguous_span(input_ids: torch.Tensor, token_id: int) -> tuple[int, int]:
    """[start, end) of the single contiguous run of `token_id` in a (1, T) id tensor."""
    where = (input_ids[0] == token_id).nonzero().flatten()
    if len(where) == 0:
        raise ValueError(f"the prompt holds no audio placeholder token (id {token_id})")
    start, end = int(where[0]), int(where[-1]) + 1
    if end - start != len(where):
        raise ValueError("the prompt's audio placeholder tokens are not contiguous (one audio clip per prompt)")
    return start, end


class Backbone:
    """Base adapter. Subclasses set the attributes below in __init__ and implement the prompt/embedding."""

    name: str
    model: nn.Module
    layers: nn.ModuleList  # decoder layers: self_attn.{q,k,v,o}_proj, input_layernorm, post_attention_layernorm, mlp
    final_norm: nn.Module
    lm_head: nn.Module
    embed_tokens: nn.Module
    rotary: nn.Module  # rotary(hidden, position_ids) -> (cos, sin), each (1, T, head_dim)
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    token_rate: float  # audio tokens per second of audio
    eos_token_ids: list[int]
    max_positions: int

    @property
    def group(self) -> int:
        return self.n_q_heads // self.n_kv_heads

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def fused_layers(self) -> list:
        """Per decoder layer, its weights with q|k|v and gate|up fused (`layer.fuse_layers`; the HF modules' own
        parameters become views into them). Made once per set of parameters: `load_backbone` makes them at load,
        and a model moved or cast since gets them made again here."""
        from wnw_exp.backbones.layer import fuse_layers

        fused = getattr(self, "_fused", None)
        if fused is None or fused[0].w_qkv.data_ptr() != self.layers[0].self_attn.q_proj.weight.data_ptr():
            self._fused = fused = fuse_layers(self.layers)
        return fused

    def rope_table(self, prompt_positions: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (n, head_dim) in the model dtype for generated tokens 0 .. n-1 (the backbone's own rotary
        embedding at `next_positions`: M-RoPE's three axes included), row i = the step that embeds token i."""
        cos, sin = self.rotary(self.embed_tokens.weight[:1][None], self.next_positions(prompt_positions, 0, n))
        return cos[0], sin[0]

    def describe(self) -> dict:
        return dict(
            name=self.name,
            n_layers=self.n_layers,
            n_q_heads=self.n_q_heads,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            token_rate=self.token_rate,
        )

    def audio_tokens_for(self, seconds: float) -> int:
        """Audio tokens a clip of `seconds` takes in the prompt (before any compute)."""
        return int(np.ceil(seconds * self.token_rate))

    def count_tokens(self, text: str) -> int | None:
        """Tokens of `text` as the model would write it (Figure 4 marks the reference length in steps)."""
        try:
            return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        except Exception:  # noqa: BLE001 - a tokenizer without that call: the length is just not known
            return None

    def check_fits(self, seconds: float, max_new_tokens: int, prompt_overhead: int = 256) -> None:
        """Refuse audio whose prompt plus answer cannot fit the model's positions, before any compute."""
        need = self.audio_tokens_for(seconds) + max_new_tokens + prompt_overhead
        if need > self.max_positions:
            limit_s = (self.max_positions - max_new_tokens - prompt_overhead) / self.token_rate
            raise ValueError(f"audio of {seconds:.0f} s needs about {need} positions but {self.name} has "
                             f"{self.max_positions}: the limit is about {limit_s:.0f} s; cut the recording")

    @staticmethod
    def place_audio(embeds: torch.Tensor, audio: torch.Tensor, prompt: Prompt) -> torch.Tensor:
        """Write the audio encoder's output (n_audio, hidden) over the prompt's audio placeholders."""
        s, e = prompt.audio_span
        if audio.shape[0] != e - s:
            raise ValueError(f"audio encoder gave {audio.shape[0]} tokens for {e - s} placeholders")
        embeds[0, s:e] = audio.to(embeds.dtype)
        return embeds

    # --- to implement -------------------------------------------------------------------------
    def build_prompt(self, audio: np.ndarray, task: str = "transcribe", language: str | None = "en",
                     target_language: str | None = None) -> Prompt:
        raise NotImplementedError

    def embed_prompt(self, prompt: Prompt) -> torch.Tensor:
        """(1, T, hidden) input embeddings with the audio encoder's output at the audio span."""
        raise NotImplementedError

    def prompt_positions(self, prompt: Prompt) -> torch.Tensor:
        """Position ids of the prompt in the shape the rotary module takes ((1, T) or (3, 1, T))."""
        raise NotImplementedError

    def next_positions(self, prompt_positions: torch.Tensor, n_done: int, n_new: int = 1) -> torch.Tensor:
        """Position ids of generated tokens n_done .. n_done+n_new-1 (0 = first generated token)."""
        raise NotImplementedError

    def decode(self, token_ids: list[int]) -> str:
        raise NotImplementedError


def find_weights(path: str | None, repo_id: str | None, required: tuple[str, ...] = ("config.json",)) -> Path:
    """Resolve a weights folder from a local path or the local hub cache, without any network access.

    transformers would otherwise retry the hub for minutes before failing on an offline machine.
    """
    hint = (
        f"Download them on a machine with internet (`huggingface-cli download {repo_id}`) and either copy the "
        f"hub cache here or pass model.path=/dir/with/config.json"
        if repo_id
        else "Pass model.path=/dir/with/config.json"
    )
    if path:
        p = Path(path).expanduser()
        if not p.is_dir():
            raise WeightsNotFoundError(f"model weights folder {p} does not exist. {hint}.")
        missing = [f for f in required if not (p / f).exists()]
        if missing:
            raise WeightsNotFoundError(f"model weights folder {p} is incomplete: missing {', '.join(missing)}. {hint}.")
        if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
            raise WeightsNotFoundError(f"model weights folder {p} holds no *.safetensors weights. {hint}.")
        for index in p.glob("*.safetensors.index.json"):
            import json

            shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
            absent = [s for s in shards if not (p / s).exists()]
            if absent:
                raise WeightsNotFoundError(f"model weights folder {p} is partial: {len(absent)} of {len(shards)} "
                                           f"shards are missing ({', '.join(absent[:3])}). {hint}.")
        return p
    if repo_id:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(snapshot_download(repo_id, local_files_only=True))
        except (LocalEntryNotFoundError, FileNotFoundError, OSError) as e:
            raise WeightsNotFoundError(
                f"weights for {repo_id} are not in the local hub cache ({e.__class__.__name__}). {hint}."
            ) from None
    raise WeightsNotFoundError(f"no model.path given. {hint}.")
