"""The tiny Voxtral: configuration, initialisation, and the training-only losses around it.

The model is the stock `VoxtralForConditionalGeneration` with a small config: a Whisper-style encoder
over 30 s windows (1500 frames, 4 frames per audio token: 12.5 audio tokens per second, like
Voxtral-Mini-3B), the GELU projector, and a Llama decoder with grouped-query attention. Nothing here
changes the architecture; the auxiliary heads below exist only while training and are not saved
with the model.

Training supervision beyond next-token cross-entropy (all from the synthetic data's word timings):
- frame labels: each audio token (after the projector) is classified as the word it lies in, and as
  the word before that one (`FrameHeads`). The encoder learns word identity and left context fast.
- guided attention: chosen query heads of chosen decoder layers are pushed to put their attention,
  at the answer position that predicts word i, on the audio tokens of word i (and, for `</s>`, on
  the audio after the last word). This makes the alignment circuit appear quickly; it is also what
  makes the tiny model's heads track the audio the way a real speech LLM's do, which WnW relies on.
- an audio-embedding scale penalty: the projector's output is kept near the RMS of a unit vector so
  that the decoder's residual stream at audio positions stays editable by attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, VoxtralConfig, VoxtralForConditionalGeneration
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.models.whisper.modeling_whisper import sinusoids

from wnw_exp.backbones.word_tokenizer import AUDIO, BOS, EOS, PAD

N_MELS = 80
AUDIO_TOKENS_PER_WINDOW = 375
GUIDED_ATTN = "wnw_guided_sdpa"


@dataclass
class TinyArch:
    """Sizes of the tiny model (defaults: the shipped model)."""

    audio_hidden: int = 256
    audio_layers: int = 4
    audio_heads: int = 4
    text_hidden: int = 256
    text_layers: int = 6
    text_heads: int = 16
    text_kv_heads: int = 8
    head_dim: int = 32
    text_mlp: int = 768
    max_positions: int = 8192
    rope_theta: float = 1e8  # Voxtral-Mini-3B's: keeps low-frequency pairs for long-range content match


def tiny_config(vocab_size: int, arch: TinyArch = TinyArch()) -> VoxtralConfig:
    audio_config = dict(
        model_type="voxtral_encoder",
        hidden_size=arch.audio_hidden,
        intermediate_size=4 * arch.audio_hidden,  # Voxtral reshapes 4 encoder frames into one token
        num_hidden_layers=arch.audio_layers,
        num_attention_heads=arch.audio_heads,
        num_mel_bins=N_MELS,
        max_source_positions=1500,
        vocab_size=vocab_size,
    )
    text_config = dict(
        model_type="llama",
        vocab_size=vocab_size,
        hidden_size=arch.text_hidden,
        intermediate_size=arch.text_mlp,
        num_hidden_layers=arch.text_layers,
        num_attention_heads=arch.text_heads,
        num_key_value_heads=arch.text_kv_heads,
        head_dim=arch.head_dim,
        max_position_embeddings=arch.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": arch.rope_theta},
        tie_word_embeddings=False,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    return VoxtralConfig(audio_config=audio_config, text_config=text_config, audio_token_id=AUDIO)


def build_tiny_model(vocab_size: int, arch: TinyArch = TinyArch(), seed: int = 0) -> VoxtralForConditionalGeneration:
    torch.manual_seed(seed)
    cfg = tiny_config(vocab_size, arch)
    model = VoxtralForConditionalGeneration(cfg)
    enc = model.model.audio_tower
    with torch.no_grad():
        # Whisper's fixed sinusoidal positions (Voxtral's init leaves them random).
        enc.embed_positions.weight.copy_(sinusoids(*enc.embed_positions.weight.shape))
        # Start the audio embeddings at the token embeddings' scale, not far above it.
        model.model.multi_modal_projector.linear_2.weight.mul_(0.25)
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = BOS, EOS, PAD
    return model


class FrameHeads(nn.Module):
    """Training-only classifiers on the projected audio embeddings: current word and previous word."""

    def __init__(self, hidden: int, vocab_size: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.current = nn.Linear(hidden, vocab_size)
        self.previous = nn.Linear(hidden, vocab_size)

    def forward(self, audio_embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(audio_embeds.float())
        return self.current(h), self.previous(h)


# --- guided attention -------------------------------------------------------------------------


@dataclass
class GuidedCapture:
    """Set for one training forward: which (layer, query head) pairs to supervise, and where.

    rows: (B, R) sequence positions of the answer rows (the position whose next token is word r);
    spans: (B, R, 2) [start, end) sequence positions of the audio tokens that row r must attend to;
    valid: (B, R) bool. After the forward, `log_mass` holds one (B, h, R) tensor per layer: the log of
    the attention probability that the supervised heads put inside the span.
    """

    layers: tuple[int, ...]
    heads: tuple[int, ...]
    rows: torch.Tensor
    spans: torch.Tensor
    valid: torch.Tensor
    log_mass: list[torch.Tensor] = field(default_factory=list)

    def loss(self) -> torch.Tensor:
        lm = torch.stack(self.log_mass)  # (L, B, h, R)
        v = self.valid[None, :, None, :].expand_as(lm)
        return -(lm[v]).mean()

    def accuracy(self) -> torch.Tensor:
        """Share of (layer, head, row) whose attention mass inside the target span exceeds one half."""
        lm = torch.stack(self.log_mass).detach()
        v = self.valid[None, :, None, :].expand_as(lm)
        return (lm[v] > -0.6931).float().mean()


_capture: GuidedCapture | None = None


def _guided_sdpa(module, query, key, value, attention_mask, scaling=None, **kwargs):
    out = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    cap = _capture
    if cap is not None and module.layer_idx in cap.layers:
        B, Hq, T, D = query.shape
        group = Hq // key.shape[1]
        heads = torch.tensor(cap.heads, device=query.device)
        q = query[:, heads].float()  # (B, h, T, D)
        k = key[:, heads // group].float()
        R = cap.rows.shape[1]
        q = torch.gather(q, 2, cap.rows[:, None, :, None].expand(B, len(cap.heads), R, D))
        scores = (q @ k.transpose(-1, -2)) * (scaling if scaling is not None else D**-0.5)  # (B, h, R, T)
        pos = torch.arange(T, device=query.device)
        causal = pos[None, None, :] <= cap.rows[:, :, None]  # (B, R, T)
        scores = scores.masked_fill(~causal[:, None], float("-inf"))
        logp = scores.log_softmax(-1)
        inside = (pos[None, None, :] >= cap.spans[..., 0:1]) & (pos[None, None, :] < cap.spans[..., 1:2])
        # finite fill: padded rows have empty spans, and an all -inf logsumexp would give NaN gradients
        cap.log_mass.append(logp.masked_fill(~inside[:, None], -1e4).logsumexp(-1))
    return out


AttentionInterface.register(GUIDED_ATTN, _guided_sdpa)
AttentionMaskInterface.register(GUIDED_ATTN, sdpa_mask)


def use_guided_attention(model: VoxtralForConditionalGeneration, on: bool) -> None:
    model.model.language_model.config._attn_implementation = GUIDED_ATTN if on else "sdpa"


# --- the training forward ---------------------------------------------------------------------


@dataclass
class LossWeights:
    frame: float = 1.0
    frame_prev: float = 0.5
    guided: float = 1.0
    scale: float = 1.0


def training_losses(
    model: VoxtralForConditionalGeneration,
    heads: FrameHeads,
    batch: dict[str, torch.Tensor],
    guided_layers: tuple[int, ...],
    guided_heads: tuple[int, ...],
    weights: LossWeights,
) -> tuple[torch.Tensor, dict[str, float]]:
    """One forward through the real model's modules; returns the total loss and logged numbers.

    batch (on the device): features (W, n_mels, 3000); ids (B, T); answer_rows (B, R) positions whose
    next token is answer token r; answer_targets (B, R) (-100 = padding); spans (B, R, 2);
    frame_cur, frame_prev (W*375,) labels of each audio token (-100 = none).
    """
    global _capture
    audio_embeds = model.get_audio_features(batch["features"]).pooler_output  # (W*375, H)
    ids = batch["ids"]
    embeds = model.model.get_input_embeddings()(ids)
    mask = (ids == AUDIO).unsqueeze(-1).expand_as(embeds)
    embeds = embeds.masked_scatter(mask, audio_embeds.to(embeds.dtype))

    valid = batch["answer_targets"] >= 0
    cap = GuidedCapture(guided_layers, guided_heads, batch["answer_rows"], batch["spans"], valid)
    _capture = cap if guided_layers else None
    try:
        hidden = model.model.language_model(inputs_embeds=embeds, use_cache=False).last_hidden_state
    finally:
        _capture = None
    rows = torch.gather(hidden, 1, batch["answer_rows"][..., None].expand(-1, -1, hidden.shape[-1]))
    logits = model.lm_head(rows).float()
    targets = batch["answer_targets"]
    ce = F.cross_entropy(logits[valid], targets[valid])
    token_acc = (logits[valid].argmax(-1) == targets[valid]).float().mean()

    cur_logits, prev_logits = heads(audio_embeds)
    frame = F.cross_entropy(cur_logits, batch["frame_cur"], ignore_index=-100)
    frame_prev = F.cross_entropy(prev_logits, batch["frame_prev"], ignore_index=-100)
    fc = batch["frame_cur"] >= 0
    frame_acc = (cur_logits[fc].argmax(-1) == batch["frame_cur"][fc]).float().mean()

    rms = audio_embeds.float().pow(2).mean(-1).sqrt()  # per audio token
    scale = F.relu(rms - 1.0).pow(2).mean()

    total = ce + weights.frame * frame + weights.frame_prev * frame_prev + weights.scale * scale
    logs = {
        "ce": ce.item(),
        "token_acc": token_acc.item(),
        "frame": frame.item(),
        "frame_acc": frame_acc.item(),
        "frame_prev": frame_prev.item(),
        "audio_rms": rms.mean().item(),
    }
    if guided_layers:
        guided = cap.loss()
        total = total + weights.guided * guided
        logs["guided"] = guided.item()
        logs["guided_acc"] = cap.accuracy().item()
    logs["loss"] = total.item()
    return total, logs
