"""Can the frozen decoder of model=whisper_smollm2 read text placed where the audio goes?

The best a projector can do is to turn the audio into the transcript's own token embeddings. This probe puts
exactly those (each token `rep` times, as the audio has about 3.5 tokens per word token) at the audio span of
the chat prompt, decodes greedily with SmolLM2 frozen, and prints the truncated WER per instruction. Measured
2026-12-01 on the 2-core CPU (one 319-word dev clip): "Repeat exactly: " before the span 56.1% (rep 1) /
109.4% (rep 3); "Transcribe the audio." after it 99.4% / 113.2% (the decoder writes something else).

    python benchmarks/decoder_copy_probe.py [--seconds 100 120]
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    from transformers import LlamaForCausalLM

    from wnw_exp.backbones.whisper_smollm2 import AUDIO_TOKEN, assemble
    from wnw_exp.data.synthetic import SyntheticDataset
    from wnw_exp.metrics.text import corpus_wer

    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, nargs=2, default=(100.0, 120.0))
    args = ap.parse_args()
    model, tok, _ = assemble(None)
    lm = LlamaForCausalLM(model.config.text_config)
    lm.model, lm.lm_head = model.model.language_model, model.lm_head
    lm.eval()
    text = SyntheticDataset(n=1, split="dev", min_seconds=args.seconds[0], max_seconds=args.seconds[1],
                            text="natural")[0].reference
    tokens = tok(text, add_special_tokens=False)["input_ids"]
    print(f"{len(text.split())} words, {len(tokens)} tokens")
    for instruction, before in (("Repeat exactly: ", True), ("Transcribe the audio.", False)):
        for rep in (1, 3):
            content = f"{instruction}{AUDIO_TOKEN}" if before else f"{AUDIO_TOKEN}\n{instruction}"
            ids = list(tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False))
            at = ids.index(model.config.audio_token_id)
            full = ids[:at] + [t for t in tokens for _ in range(rep)] + ids[at + 1:]
            with torch.no_grad():
                x = lm.model.embed_tokens(torch.tensor([full]))
                out = lm.generate(inputs_embeds=x, attention_mask=torch.ones(1, x.shape[1], dtype=torch.long),
                                  max_new_tokens=int(len(tokens) * 1.3), do_sample=False)
            hyp = tok.decode(out[0], skip_special_tokens=True)
            print(f"{instruction!r:24} {'before' if before else 'after':6} rep {rep}: WER {corpus_wer([(text, hyp)]):6.1f}%"
                  f"  {hyp[:80]!r}")


if __name__ == "__main__":
    main()
