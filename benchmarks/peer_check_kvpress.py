"""Peer check of our SnapKV scores and AdaKV allocation (src/wnw_exp/methods/scoring.py) against kvpress.

kvpress (NVIDIA, on PyPI) is a peer, not a dependency: it pins transformers < 5.3, the project needs 5.17,
so it lives in its own virtual environment and sees only tensors dumped from ours:

    python3 -m venv /tmp/kvpress-venv
    /tmp/kvpress-venv/bin/pip install torch==2.13.0 kvpress==0.5.5
    .venv/bin/python benchmarks/peer_check_kvpress.py --kvpress-python /tmp/kvpress-venv/bin/python

Stage `dump` (project venv): a tiny random Voxtral (3 layers, 8 query / 4 KV heads) prefills a 30 s clip
through our engine; per layer we save the attention input (after input_layernorm), the post-RoPE keys,
RoPE's cos / sin, q_proj's weight, and the engine's `PrefillScores.post_audio`.
Stage `compare` (kvpress venv): kvpress's own code computes the scores and kept positions from those
tensors, ours from `post_audio`, with the same window (the prompt tokens after the audio), kernel 7 and
alpha; the report says where they agree and explains every difference.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

SRC = Path(__file__).resolve().parents[1] / "src"
KERNEL = 7
RETENTIONS = (0.2, 0.6)
ALPHAS = (1.0, 0.0, 0.8)


# --- stage 1: our engine, project venv -------------------------------------------------------------------
def dump(path: Path, seconds: float = 30.0) -> None:
    import numpy as np
    from transformers import VoxtralForConditionalGeneration, WhisperFeatureExtractor

    from wnw_exp.backbones.tiny_random import tiny_voxtral_config
    from wnw_exp.backbones.voxtral import VoxtralBackbone
    from wnw_exp.backbones.word_tokenizer import build_word_tokenizer
    from wnw_exp.backbones.layer import apply_rope
    from wnw_exp.engine.serve import generate
    from wnw_exp.methods.base import Policy

    class Recorder(Policy):
        """Keeps each layer's prefill input and the engine's post-audio attention; changes nothing."""

        def start(self, ctx, store):
            super().start(ctx, store)
            self.inputs, self.post = [], []

        def prefill_transform(self, layer, hidden, positions, audio_span):
            self.inputs.append((hidden.clone(), positions))
            return hidden, positions, audio_span

        def place(self, layer, scores):
            self.post.append(scores.post_audio.clone())

    tok = build_word_tokenizer([f"w{i}" for i in range(300)])
    cfg = tiny_voxtral_config(len(tok))
    cfg.text_config.initializer_range = 0.2  # peaked attention, as in the engine tests
    torch.manual_seed(0)
    model = VoxtralForConditionalGeneration(cfg).eval()
    backbone = VoxtralBackbone(model, "tiny_peer", tokenizer=tok,
                               feature_extractor=WhisperFeatureExtractor(feature_size=80))
    audio = (np.random.RandomState(0).randn(int(16000 * seconds)) * 0.1).astype(np.float32)
    prompt = backbone.build_prompt(audio)
    rec = Recorder()
    generate(backbone, prompt, rec, retention=1.0, max_new_tokens=1)
    layers = []
    with torch.no_grad():
        for li, layer in enumerate(backbone.layers):
            hidden, positions = rec.inputs[li]
            cos, sin = backbone.rotary(hidden, positions)
            x = layer.input_layernorm(hidden)
            k = layer.self_attn.k_proj(x).view(1, x.shape[1], backbone.n_kv_heads, backbone.head_dim).transpose(1, 2)
            layers.append(dict(x=x, keys=apply_rope(k, cos, sin), cos=cos, sin=sin,
                               q_weight=layer.self_attn.q_proj.weight.detach().clone(),
                               scaling=layer.self_attn.scaling, post_audio=rec.post[li]))
    torch.save(dict(layers=layers, audio_span=prompt.audio_span, n_prompt=prompt.input_ids.shape[1],
                    n_q=backbone.n_q_heads, n_kv=backbone.n_kv_heads, head_dim=backbone.head_dim), path)
    print(f"dumped {len(layers)} layers, prompt {prompt.input_ids.shape[1]} tokens, audio {prompt.audio_span}")


# --- stage 2: kvpress, its own venv ----------------------------------------------------------------------
def compare(path: Path) -> None:
    from contextlib import nullcontext
    from dataclasses import dataclass
    from importlib.metadata import version
    from types import SimpleNamespace
    from unittest import mock

    import torch.nn.functional as F
    from torch import nn

    from kvpress import AdaKVPress, ScorerPress, SnapKVPress
    from kvpress.presses import snapkv_press

    sys.path.insert(0, str(SRC))
    from wnw_exp.methods.scoring import adakv_capacities, group_mean, keep_top, pool1d, snapkv_scores, window_mean

    d = torch.load(path)
    s, e = d["audio_span"]
    n_q, n_kv, head_dim, T = d["n_q"], d["n_kv"], d["head_dim"], d["n_prompt"]
    n_audio, window, g = e - s, d["n_prompt"] - e, d["n_q"] // d["n_kv"]
    print(f"kvpress {version('kvpress')}, transformers {version('transformers')}, torch {torch.__version__}; "
          f"tiny Voxtral: {len(d['layers'])} layers, H_q {n_q}, H_kv {n_kv}; prompt {T} tokens = {s} before the "
          f"audio + {n_audio} audio + {window} after (the observation window); kernel {KERNEL}")

    class Attention(nn.Module):
        """What kvpress reads from an attention module: q_proj, head_dim and the config's head counts."""

        def __init__(self, q_weight):
            super().__init__()
            self.q_proj = nn.Linear(q_weight.shape[1], q_weight.shape[0], bias=False)
            self.q_proj.weight.data.copy_(q_weight)
            self.head_dim = head_dim
            self.config = SimpleNamespace(num_attention_heads=n_q, num_key_value_heads=n_kv,
                                          _attn_implementation="sdpa")

    @dataclass
    class Given(ScorerPress):
        """A ScorerPress whose scores are given: runs kvpress's AdaKV allocation on the audio columns only."""

        given: torch.Tensor = None

        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            return self.given.clone()[None]

    def kvpress_scores(layer, mode: str, attentions=None) -> torch.Tensor:
        module = Attention(layer["q_weight"])
        press = SnapKVPress(window_size=window, kernel_size=KERNEL)
        patch = mock.patch.object(snapkv_press.F, "avg_pool1d", F.max_pool1d) if mode == "max" else nullcontext()
        with torch.no_grad(), patch:
            if attentions is None:
                out = press.score(module, layer["x"], layer["keys"], None, None,
                                  {"position_embeddings": (layer["cos"], layer["sin"])})
                return out[0, :, s:e]  # its keys are [0, T - window): the prompt before the audio, then the audio
            out = press.score(module, torch.zeros(1, n_audio + window, 1), torch.zeros(1, n_kv, n_audio + window, 1),
                              None, attentions, {})
            return out[0, :, :n_audio]

    def kvpress_keep(scores: torch.Tensor, budget: int, alpha: float) -> list[set[int]]:
        press = AdaKVPress(Given(compression_ratio=0.0, given=scores), alpha_safeguard=alpha)
        press.compression_ratio = 1 - (budget + 0.5) / n_audio  # its int(n * (1 - ratio)) is then our budget
        module = Attention(torch.zeros(n_q * head_dim, 1))
        press.compress(module, None, torch.zeros(1, n_kv, n_audio, 1), None, None, {})
        _, heads, pos = module.masked_key_indices
        return [set(range(n_audio)) - set(pos[heads == h].tolist()) for h in range(n_kv)]

    def same_up_to_ties(scores, a: list[set[int]], b: list[set[int]]) -> bool:
        """Kept sets of equal size whose kept scores are the same multiset (they differ only among ties)."""
        return all(len(x) == len(y) and torch.equal(torch.sort(scores[h, sorted(x)]).values,
                                                    torch.sort(scores[h, sorted(y)]).values)
                   for h, (x, y) in enumerate(zip(a, b)))

    worst = dict(attn=0.0, avg_inner=0.0, avg_border=0.0, avg_audio_only=0.0, max_kv_order=0.0, max_order_gap=0.0)
    keep_rows = []
    for li, layer in enumerate(d["layers"]):
        post = layer["post_audio"].float()  # (H_q, window, n_audio) from our engine
        # 1. The window attention itself: kvpress recomputes it from q_proj, RoPE and the keys.
        with torch.no_grad():
            ref = SnapKVPress.compute_window_attention(Attention(layer["q_weight"]), layer["x"], layer["keys"], window,
                                                       (layer["cos"], layer["sin"]))[0, :, :, s:e]
        worst["attn"] = max(worst["attn"], float((ref - post).abs().max()))
        # 2. Average pooling (kvpress's SnapKV as shipped): our scores vs kvpress from the model's tensors.
        ours_avg = snapkv_scores(post, window=window, kernel=KERNEL, pooling="avg", group=g)
        theirs = kvpress_scores(layer, "avg")
        r = KERNEL // 2
        worst["avg_inner"] = max(worst["avg_inner"], float((ours_avg - theirs)[:, r:].abs().max()))
        worst["avg_border"] = max(worst["avg_border"], float((ours_avg - theirs)[:, :r].abs().max()))
        # The same scorer fed the engine's audio-only window attention: the border difference disappears.
        att = torch.zeros(1, n_q, n_audio + window, n_audio + window)
        att[0, :, n_audio:, :n_audio] = post
        worst["avg_audio_only"] = max(worst["avg_audio_only"],
                                      float((ours_avg - kvpress_scores(layer, "avg", att)).abs().max()))
        # 3. Max pooling (Appendix F): kvpress's scorer with its avg_pool1d call swapped for max_pool1d pools
        # each query head, then averages the group; AdaKV's code (and our adakv) averages, then pools.
        theirs_max = kvpress_scores(layer, "max", att)
        ours_kv_order = group_mean(pool1d(window_mean(post, window), KERNEL, "max"), g)
        ours_max = snapkv_scores(post, window=window, kernel=KERNEL, pooling="max", group=g)
        worst["max_kv_order"] = max(worst["max_kv_order"], float((ours_kv_order - theirs_max).abs().max()))
        worst["max_order_gap"] = max(worst["max_order_gap"], float((ours_max - theirs_max).abs().max()))
        # 4. Kept positions: kvpress's AdaKVPress vs AdaKV's rule (ours), on identical scores.
        for retention in RETENTIONS:
            budget = round(retention * n_audio)
            for alpha in ALPHAS:
                for name, sc in (("avg", ours_avg), ("max", ours_max)):
                    theirs_keep = kvpress_keep(sc, budget, alpha)
                    caps = adakv_capacities(sc, budget, alpha)
                    ours_keep = [set(k.tolist()) for k in keep_top(sc, caps)]
                    inter = sum(len(a & b) for a, b in zip(ours_keep, theirs_keep))
                    union = sum(len(a | b) for a, b in zip(ours_keep, theirs_keep))
                    keep_rows.append(dict(layer=li, retention=retention, alpha=alpha, pooling=name,
                                          exact=ours_keep == theirs_keep,
                                          ties=same_up_to_ties(sc, ours_keep, theirs_keep), jaccard=inter / union,
                                          caps_ours=caps.tolist(), caps_kvpress=[len(x) for x in theirs_keep]))
        # Our max-pooled order vs kvpress's, as kept positions of our adakv (alpha 0.8, retention 0.2).
        b = round(0.2 * n_audio)
        a_keep = [set(k.tolist()) for k in keep_top(ours_max, adakv_capacities(ours_max, b, 0.8))]
        k_keep = [set(k.tolist()) for k in keep_top(theirs_max, adakv_capacities(theirs_max, b, 0.8))]
        keep_rows.append(dict(layer=li, retention=0.2, alpha=0.8, pooling="max: AdaKV order vs kvpress order",
                              exact=a_keep == k_keep, ties=False,
                              jaccard=sum(len(x & y) for x, y in zip(a_keep, k_keep))
                              / sum(len(x | y) for x, y in zip(a_keep, k_keep)), caps_ours=[], caps_kvpress=[]))

    print("\nScores (max |ours - kvpress| over layers, heads and audio positions):")
    print(f"  window attention (engine vs kvpress.compute_window_attention)      {worst['attn']:.2e}")
    print(f"  SnapKV avg-pool, from the model's tensors, positions >= {r}          {worst['avg_inner']:.2e}")
    print(f"  SnapKV avg-pool, from the model's tensors, first {r} audio positions  {worst['avg_border']:.2e}"
          "   <- kvpress's pooling window reaches into the prompt before the audio")
    print(f"  SnapKV avg-pool, kvpress fed the audio-only window attention        {worst['avg_audio_only']:.2e}")
    print(f"  SnapKV max-pool, same order as kvpress (pool, then group mean)      {worst['max_kv_order']:.2e}")
    print(f"  SnapKV max-pool, AdaKV's order (group mean, then pool) vs kvpress's  {worst['max_order_gap']:.2e}"
          "   <- max does not commute with the mean")
    print("\nKept positions (all layers): exact = identical sets; ties = identical up to equal scores; "
          "Jaccard = |ours & kvpress| / |ours | kvpress| summed over heads")
    print(f"  {'retention':>9} {'alpha':>5} {'pooling':<36} {'exact':>7} {'ties':>7} {'Jaccard':>8}  "
          "per-head budgets (ours / kvpress), layer 0")
    groups = {}
    for row in keep_rows:
        groups.setdefault((row["retention"], row["alpha"], row["pooling"]), []).append(row)
    for (retention, alpha, pooling), rows in groups.items():
        n = len(rows)
        caps = f"{rows[0]['caps_ours']} / {rows[0]['caps_kvpress']}" if rows[0]["caps_ours"] else ""
        print(f"  {retention:>9} {alpha:>5} {pooling:<36} {sum(r['exact'] for r in rows):>3}/{n:<3} "
              f"{sum(r['ties'] for r in rows):>3}/{n:<3} {min(r['jaccard'] for r in rows):>8.3f}  {caps}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", nargs="?", choices=["dump", "compare"], help="run one stage only")
    ap.add_argument("path", nargs="?", default="/tmp/wnw_peer_check_kvpress.pt")
    ap.add_argument("--kvpress-python", help="python of the kvpress venv: dump here, then compare there")
    args = ap.parse_args()
    path = Path(args.path)
    if args.stage == "dump" or args.stage is None:
        dump(path)
    if args.stage == "compare":
        compare(path)
    elif args.stage is None:
        if not args.kvpress_python:
            sys.exit("give --kvpress-python /path/to/kvpress-venv/bin/python (see this file's docstring)")
        subprocess.run([args.kvpress_python, __file__, "compare", str(path)], check=True)


if __name__ == "__main__":
    main()
