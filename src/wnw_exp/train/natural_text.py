"""Writes the natural-text corpus that `wnw_exp.data.natural_text` reads (once, offline; the corpus ships).

SmolLM2-135M-Instruct (the decoder of `model=whisper_smollm2`) writes passages from fixed prompts: a form
("a news report", "a letter to a friend") about a subject, the subjects split between test, dev, calib and
train as `wnw_exp.data.natural_text.SPLITS` says. The generator lives with training, not with the data sets,
because it needs the language model: the reader stays free of any backbone.

    python -m wnw_exp.train.natural_text generate --device cuda --batch-size 512
    python -m wnw_exp.train.natural_text stats
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from wnw_exp.data.natural_text import CORPUS, SPLITS, SUBJECTS, split_sentences

FORMS = (
    "a short story", "a news report", "a letter to a friend", "an explanation for a curious child",
    "a travel diary entry", "a short speech", "a description", "a radio talk",
)
SAMPLES_PER_PROMPT = {"test": 2, "dev": 1, "calib": 2, "train": 6}


def prompts() -> list[dict]:
    """Every (split, subject, form, sample) to generate, test first, so a partial corpus has the held-out text."""
    out = []
    for split in ("test", "calib", "dev", "train"):
        for i in SPLITS[split]:
            for form in FORMS:
                for k in range(SAMPLES_PER_PROMPT[split]):
                    out.append(dict(id=f"{split}-{i:03d}-{FORMS.index(form)}-{k}", split=split, subject=SUBJECTS[i],
                                    form=form, sample=k))
    return out


def instruction(subject: str, form: str) -> str:
    return f"Write {form} of about 200 words about {subject}. Use plain sentences, no lists or headings."


def generate(out: Path, batch_size: int = 64, max_new_tokens: int = 320, seed: int = 0, limit: int | None = None,
             threads: int = 1, splits: tuple[str, ...] = tuple(SPLITS), device: str = "cpu") -> None:
    """Write (append, resumable) one JSON line per prompt of `prompts()` in `splits` to `out` (gzip if it ends
    in .gz). Sampling seeds depend on the batch, so a corpus is reproduced by the same command on the same
    device and torch build."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from wnw_exp.backbones.whisper_smollm2 import language_model_dir

    torch.set_num_threads(threads)
    folder, source = language_model_dir()
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    if tok.pad_token is None:  # some transformers versions read no pad token from the GGUF
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().to(device)
    todo = [p for p in prompts() if p["split"] in splits][:limit]
    done = set()
    opener = gzip.open if str(out).endswith(".gz") else open
    if Path(out).exists():
        with opener(out, "rt", encoding="utf-8") as f:
            done = {json.loads(line)["id"] for line in f if line.strip()}
    todo = [p for p in todo if p["id"] not in done]
    for b in range(0, len(todo), batch_size):
        batch = todo[b:b + batch_size]
        chats = [tok.apply_chat_template([{"role": "user", "content": instruction(p["subject"], p["form"])}],
                                         add_generation_prompt=True, tokenize=False) for p in batch]
        enc = tok(chats, return_tensors="pt", padding=True).to(device)
        torch.manual_seed(seed * 1_000_003 + len(done) + b)
        with torch.no_grad():
            ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, temperature=0.8, top_p=0.9,
                                 repetition_penalty=1.15, pad_token_id=tok.pad_token_id)
        with opener(out, "at", encoding="utf-8") as f:
            for p, row in zip(batch, ids[:, enc.input_ids.shape[1]:]):
                text = tok.decode(row, skip_special_tokens=True).strip()
                f.write(json.dumps(dict(p, text=text, source=source, device=torch.device(device).type),
                                   ensure_ascii=False) + "\n")
        print(f"{min(b + batch_size, len(todo))}/{len(todo)} passages", flush=True)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="generate the natural-text corpus with SmolLM2 (once)")
    ap.add_argument("command", choices=["generate", "stats"])
    ap.add_argument("--out", type=Path, default=CORPUS)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--splits", default=",".join(SPLITS), help="comma-separated: test,dev,calib,train")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.command == "generate":
        args.out.parent.mkdir(parents=True, exist_ok=True)
        generate(args.out, batch_size=args.batch_size, limit=args.limit, threads=args.threads,
                 splits=tuple(args.splits.split(",")), device=args.device)
    else:
        for split in SPLITS:
            try:
                ps = split_sentences(split, str(args.out))
            except ValueError:
                continue
            words = sum(len(s.split()) for p in ps for s in p)
            print(f"{split}: {len(ps)} passages, {sum(map(len, ps))} sentences, {words} words")


if __name__ == "__main__":
    main()
