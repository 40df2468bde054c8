"""Voice score (Eq. 3) and head sensitivity (Eqs. 4-5) from one teacher-forced pass per sample.

The pass runs the backbone's own modules layer by layer (`backbones.layer.decoder_layer`, the engine's layer
body) on the prompt followed by the reference answer tokens:

- Keys are taken after RoPE (RoPE is a rotation, so gradient norms are the same before it) and passed
  to `torch.autograd.grad` as inputs: it returns the total derivative dL/dK_{l,k,tau}, including the
  paths through later layers (the input embeddings are the graph's leaf, the weights stay frozen). For
  a selection of answer tokens t (`hs_tokens`, evenly spaced; null = all) one backward pass of that
  token's cross-entropy gives
  S_{l,k,tau} = ||dL_t/dK_{l,k,tau}||_2; its mean over the audio positions tau, then over the tokens,
  is the sample's HS_{l,k}.
- The row that predicts answer token t (the row of the token before it: the query of the decode step
  that emits t) ranks the audio keys of every query head by q.k (the softmax is monotone within a
  row, so these are the softmax's top-K audio positions); hit_{l,h,t} is the fraction of the top-K that
  fall in t's word span [floor(a r_tok), floor(b r_tok)) (Appendix E). Tokens without an aligned word
  (the end token, punctuation-only tokens, words WhisperX could not align or scored below 0.85) are
  skipped.

Per sample the hits are averaged over its scored tokens and the sensitivities over its gradient tokens;
the calibration set's value is the mean over samples (E_D[E_t[...]], Eq. 5); VS of a KV head is the
mean over its GQA group's query heads.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from wnw_exp.backbones.base import Backbone, Prompt
from wnw_exp.backbones.layer import causal_attention, decoder_layer
from wnw_exp.data.base import Word

_ALNUM = re.compile(r"\w", re.UNICODE)


def default_k_top(token_rate: float) -> int:
    """K of Eq. (3): about one spoken word (0.32 s), 4 at 12.5 tokens/s (Voxtral), 8 at 25 (Qwen2.5-Omni)."""
    return max(1, round(0.32 * token_rate))


# --- answer tokens <-> reference words -------------------------------------------------------------
def answer_token_words(tokenizer, reference: str) -> tuple[list[int], list[int | None]]:
    """The reference's token ids (no special tokens) and, per token, the index of the whitespace-split
    reference word it belongs to (None for tokens with no letter or digit, e.g. punctuation or spaces).

    Uses the fast tokenizer's character offsets when it has them; otherwise decodes the ids
    incrementally and counts the words of each prefix (any tokenizer with encode/decode)."""
    word_spans = [(m.start(), m.end()) for m in re.finditer(r"\S+", reference)]
    char_word = np.full(len(reference) + 1, -1, dtype=np.int64)
    for i, (s, e) in enumerate(word_spans):
        char_word[s:e] = i
    try:
        enc = tokenizer(reference, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    except (NotImplementedError, TypeError, ValueError, KeyError, AttributeError):
        ids, offsets = None, None
    if ids is not None and offsets is not None and len(offsets) == len(ids):
        words: list[int | None] = []
        for s, e in offsets:
            idx = [c for c in range(s, e) if _ALNUM.match(reference[c]) and char_word[c] >= 0]
            words.append(int(char_word[idx[0]]) if idx else None)
        return ids, words
    ids = list(tokenizer.encode(reference, add_special_tokens=False))
    return ids, _words_by_incremental_decode(tokenizer, ids)


def _words_by_incremental_decode(tokenizer, ids: list[int]) -> list[int | None]:
    words: list[int | None] = []
    prev = ""
    for i in range(len(ids)):
        text = tokenizer.decode(ids[: i + 1], skip_special_tokens=True)
        piece = text[len(prev):] if text.startswith(prev) else text[len(prev.rstrip()):]
        words.append(len(text.split()) - 1 if _ALNUM.search(piece) else None)
        prev = text
    return words


def token_audio_spans(word_of_token: list[int | None], words: list[Word | None], token_rate: float,
                      n_audio: int) -> list[tuple[int, int] | None]:
    """Per answer token, its word's span in audio-token indices [floor(a r), floor(b r)), or None."""
    spans: list[tuple[int, int] | None] = []
    for wi in word_of_token:
        w = words[wi] if wi is not None and wi < len(words) else None
        if w is None:
            spans.append(None)
            continue
        a = min(max(math.floor(w.start * token_rate), 0), n_audio)
        b = min(max(math.floor(w.end * token_rate), 0), n_audio)
        spans.append((a, b))
    return spans


# --- one teacher-forced pass -----------------------------------------------------------------------
@dataclass
class SampleScores:
    hit: np.ndarray | None  # (L, H_q) mean hit ratio over the scored tokens; None if none was scored
    sensitivity: np.ndarray  # (L, H_kv) mean over gradient tokens of mean_tau ||dL_t/dK||
    n_vs_tokens: int
    n_hs_tokens: int
    seconds: float
    attention: dict | None = None  # (L, H_kv) head statistics of the answer rows (`attention_statistics`)


def gradient_tokens(n_targets: int, hs_tokens: int | None) -> list[int]:
    """Evenly spaced target indices whose loss gradient enters HS (all when hs_tokens is None)."""
    if hs_tokens is None or hs_tokens >= n_targets:
        return list(range(n_targets))
    if hs_tokens <= 0:
        return []
    return sorted({round(i * (n_targets - 1) / max(hs_tokens - 1, 1)) for i in range(hs_tokens)})


def score_sample(backbone: Backbone, prompt: Prompt, answer_ids: list[int],
                 spans: list[tuple[int, int] | None], k_top: int, hs_tokens: int | None) -> SampleScores:
    """VS hits and HS of one sample, teacher-forced on `answer_ids` (followed by the end token)."""
    t0 = time.perf_counter()
    dev = backbone.device
    n_q, n_kv, d, g = backbone.n_q_heads, backbone.n_kv_heads, backbone.head_dim, backbone.group
    n_layers = backbone.n_layers
    P = prompt.input_ids.shape[1]
    s, e = prompt.audio_span
    n_audio = e - s
    targets = list(answer_ids) + [backbone.eos_token_ids[0]]
    ids = torch.cat([prompt.input_ids, torch.tensor([list(answer_ids)], dtype=prompt.input_ids.dtype)], dim=1)
    if ids.shape[1] > backbone.max_positions:
        raise ValueError(f"prompt plus reference ({ids.shape[1]} tokens) exceeds the model's context of "
                         f"{backbone.max_positions} positions")
    full = Prompt(ids, prompt.audio_span, prompt.audio_inputs)
    rows = torch.arange(P - 1, P - 1 + len(targets), device=dev)  # row i predicts targets[i]

    vs_idx = [j for j, sp in enumerate(spans[: len(answer_ids)]) if sp is not None]
    vs_rows = rows[vs_idx] if vs_idx else None
    if vs_idx:
        span_a = torch.tensor([spans[j][0] for j in vs_idx], device=dev)[None, :, None]
        span_b = torch.tensor([spans[j][1] for j in vs_idx], device=dev)[None, :, None]
    k_eff = min(k_top, n_audio)
    hits = torch.zeros(n_layers, n_q, dtype=torch.float64)

    params = [p for p in backbone.model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        with torch.enable_grad():
            # The embeddings are the graph's leaf; keys stay in it (a detached key would cut the paths from
            # earlier keys through later layers' keys), and autograd.grad takes them as inputs.
            hidden = backbone.embed_prompt(full).detach().requires_grad_(True)
            pos = backbone.prompt_positions(full)
            cos, sin = backbone.rotary(hidden, pos)
            keys, stats = [], []

            def attention(q, k, v, scale):
                """Full causal attention; keeps the layer's keys (autograd inputs) and its statistics."""
                li = len(keys)
                keys.append(k)
                with torch.no_grad():
                    stats.append(attention_statistics(q[0][:, rows], k[0], rows, (s, e), scale, g))
                    if vs_idx:
                        qa = q[0][:, vs_rows].float()  # (H_q, n_v, D)
                        ka = k[0, :, s:e].float().repeat_interleave(g, dim=0)  # (H_q, n_audio, D)
                        top = torch.einsum("hnd,hkd->hnk", qa, ka).topk(k_eff, dim=-1).indices
                        hit = ((top >= span_a) & (top < span_b)).float().mean(-1)  # (H_q, n_v)
                        hits[li] = hit.sum(-1).double().cpu()
                return causal_attention(q, k, v, scale)

            for layer in backbone.layers:
                hidden = decoder_layer(layer, hidden, cos, sin, attention, (n_q, n_kv, d))
            logits = backbone.lm_head(backbone.final_norm(hidden[:, rows]))[0].float()
            losses = F.cross_entropy(logits, torch.tensor(targets, device=dev), reduction="none")
            chosen = gradient_tokens(len(targets), hs_tokens)
            sens = torch.zeros(n_layers, n_kv, dtype=torch.float64)
            for i, t in enumerate(chosen):
                grads = torch.autograd.grad(losses[t], keys, retain_graph=i < len(chosen) - 1)
                for li, gk in enumerate(grads):
                    sens[li] += gk[0, :, s:e].float().norm(dim=-1).mean(-1).double().cpu()
    finally:
        for p in params:
            p.requires_grad_(True)
    n_v = len(vs_idx)
    return SampleScores(
        hit=(hits / n_v).numpy() if n_v else None,
        sensitivity=(sens / max(len(chosen), 1)).numpy(),
        n_vs_tokens=n_v, n_hs_tokens=len(chosen), seconds=time.perf_counter() - t0,
        attention={name: np.stack([st[name] for st in stats]) for name in stats[0]},
    )


AUDIO_MASS = 0.9  # the share of a row's audio attention whose covering positions `attention_statistics` counts


def attention_statistics(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, span: tuple[int, int], scale: float,
                         group: int) -> dict[str, np.ndarray]:
    """What kind of head each KV head is, from the answer rows' full-cache attention (teacher-forced):

    - `first_token`: the mean attention weight on position 0 (the attention sink of a pretrained LM);
    - `audio`: the mean attention mass on the audio span;
    - `audio_positions_90`: the fewest audio positions holding 90% of a row's audio mass, as a fraction of the
      audio, averaged over rows (small: a sparse head a static subset can serve; large: a broad one).
    q: (H_q, n_rows, D) queries of the rows; k: (H_kv, T, D); means over the rows, then over each KV head's
    group of query heads; each (H_kv,) float64."""
    s, e = span
    kk = k.repeat_interleave(group, dim=0).float()
    logits = torch.einsum("hrd,htd->hrt", q.float(), kk) * scale
    logits = logits.masked_fill(torch.arange(k.shape[1], device=k.device)[None, None] > rows[None, :, None],
                                float("-inf"))
    p = torch.softmax(logits, dim=-1)
    audio = p[..., s:e]
    mass = audio.sum(-1, keepdim=True).clamp_min(1e-30)
    cum = torch.cumsum(torch.sort(audio / mass, dim=-1, descending=True).values, dim=-1)
    n90 = (cum < AUDIO_MASS).sum(-1).float() + 1  # positions up to and including the one crossing 90%
    h_kv = k.shape[0]
    per_kv = lambda x: x.mean(-1).view(h_kv, group).mean(-1).double().cpu().numpy()  # noqa: E731
    return dict(first_token=per_kv(p[..., 0]), audio=per_kv(mass[..., 0]),
                audio_positions_90=per_kv(n90 / max(e - s, 1)))


def group_mean(per_q_head: np.ndarray, n_kv_heads: int) -> np.ndarray:
    """(L, H_q) -> (L, H_kv): mean over each KV head's GQA group (query heads k*g .. k*g+g-1)."""
    L, H_q = per_q_head.shape
    return per_q_head.reshape(L, n_kv_heads, H_q // n_kv_heads).mean(-1)

