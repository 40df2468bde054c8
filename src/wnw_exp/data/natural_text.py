"""Natural English text for the synthetic speech of `dataset=synthetic dataset.text=natural`.

Source: passages written by SmolLM2-135M-Instruct (Apache-2.0; the decoder of `model=whisper_smollm2`)
from fixed prompts, sampled once with a fixed seed on one H200 on 2026-12-01 (`python -m wnw_exp.data.natural_text
generate --device cuda --batch-size 512`, torch 2.11, transformers 5.17: 3,696 passages in 131 s; then, at
16:22 UTC, `... --splits train` after the train samples per prompt went from 3 to 6: 2,976 more train passages
in about 100 s, appended, the earlier lines unchanged; another device or torch build samples other text) and
shipped as `natural_text/passages.jsonl.gz` (3.1 MB; train 742k words, test 42k, calib 42k, dev 9k):
an offline source with a clear licence, since nothing may be downloaded. The prompts combine a subject
with a form ("a news report about ...", "a letter to a friend about ..."); the subjects are split
between test, dev, calib and train (`SPLIT_OF_SUBJECT`), so no test, dev or calibration text is ever
trained on, not even a passage on the same subject.

Clean-up (`sentences`, a pure function of the raw text): markdown and list lines are dropped, the text
is split into sentences, and a sentence is kept only if it is 3-40 words of letters with the
punctuation , . ; : ! ? ' - (no digits, quotes, brackets or symbols: espeak-ng would read them in ways
a transcript cannot score), with no ellipsis and no word without a letter; repeated sentences within a passage are dropped (a small LM loops).
"""

from __future__ import annotations

import gzip
import json
import re
from functools import lru_cache
from pathlib import Path

CORPUS = Path(__file__).parent / "natural_text" / "passages.jsonl.gz"

FORMS = (
    "a short story", "a news report", "a letter to a friend", "an explanation for a curious child",
    "a travel diary entry", "a short speech", "a description", "a radio talk",
)
SUBJECTS = (
    # test (20)
    "a lighthouse keeper", "the history of bread", "how bees communicate", "a night train across the mountains",
    "an old clockmaker", "learning to swim", "a flooded village", "the first day at a new school",
    "a lost dog finding its way home", "how volcanoes form", "a small bakery in the city", "a winter storm",
    "the life of a river", "a market in the morning", "an astronaut's journey", "a grandmother's garden",
    "the invention of the telephone", "a football match in the rain", "a forest fire", "a village festival",
    # dev (10)
    "a fishing boat at dawn", "how trees grow", "a museum at night", "a broken bicycle", "the moon landing",
    "a busy hospital", "a summer camp", "the history of paper", "a desert caravan", "a street musician",
    # calib (20)
    "a mountain rescue", "how clouds form", "an island far away", "a young painter", "the history of the bicycle",
    "a family dinner", "a snowy morning", "a train station", "the life of an ant colony", "a chess tournament",
    "an old castle", "a rainy afternoon", "how a ship is built", "a farmer's year", "the ocean floor",
    "a school play", "a library", "a thunderstorm", "a kite festival", "a long walk in the countryside",
    # train (the rest)
    "a dragon who cannot fly", "how electricity works", "a cooking competition", "a lost wallet",
    "the history of writing", "a city park", "a robot learning to paint", "a journey by canoe", "a tiny mouse",
    "the solar system", "a birthday party", "an ancient library", "how rain is made", "a cat on a roof",
    "the history of music", "a detective and a missing ring", "a farmers market", "a hot air balloon",
    "a small town newspaper", "a pilot in a storm", "the life of a butterfly", "how glass is made",
    "a wedding in the village", "a haunted house", "the first snow of the year", "a ferry crossing",
    "a science fair", "a young inventor", "the history of maps", "a bear in the forest", "a quiet beach",
    "a runaway horse", "how the heart works", "a mail carrier", "a jazz club", "the life of a tree",
    "a camping trip", "a friendly giant", "how coffee is grown", "a rescue at sea", "a lonely robot",
    "the history of trains", "a garden in spring", "a baker and a king", "the Arctic", "a pirate ship",
    "a hospital nurse", "how a bridge is built", "a talking parrot", "an old photograph", "a city at night",
    "the history of medicine", "a wolf pack", "a flower shop", "a mountain village", "the rainforest",
    "a clever fox", "a shipwreck", "how plants drink water", "a violin maker", "a windy day",
    "the history of money", "a bus driver", "a magic lamp", "a zoo keeper", "the life of a whale",
    "a long winter", "how honey is made", "a soldier coming home", "a fairy in the woods", "a bookshop",
    "the history of the Olympic games", "a road trip", "a carpenter", "a comet", "a girl who could talk to birds",
    "a piano lesson", "how mountains are made", "a busy airport", "a sleepy dragon", "an underwater city",
    "the history of cheese", "a knight and a princess", "a coal miner", "a frozen lake", "a spaceship crew",
    "a children's hospital", "how bread rises", "a market in the desert", "a secret tunnel", "a thunderbird",
    "the history of the printing press", "a family of owls", "a restaurant kitchen", "a storm at sea",
    "a little red boat", "how the brain learns", "an autumn forest", "a carnival", "a lost island",
    "the history of glass", "a gardener and a rose", "a monkey in the jungle", "a country doctor",
    "a sunrise over the hills", "how cheese is made", "a giant turtle", "a brave little mouse", "a weather report",
    "the history of chocolate", "a teacher's last day", "a dolphin", "a tailor", "a stormy night",
    "how airplanes fly", "an old sailor", "a busy harbour", "the history of the calendar", "a snowman",
    "a magician", "a train robbery", "a farm in summer", "the life of a honeybee", "a potter",
)
SPLITS = {"test": range(0, 20), "dev": range(20, 30), "calib": range(30, 50), "train": range(50, len(SUBJECTS))}
SPLIT_OF_SUBJECT = {SUBJECTS[i]: split for split, r in SPLITS.items() for i in r}
SAMPLES_PER_PROMPT = {"test": 2, "dev": 1, "calib": 2, "train": 6}

_ALLOWED = re.compile(r"^[A-Za-z ,.;:!?'\-]+$")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_HAS_LETTER = re.compile(r"[A-Za-z]")


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


def sentences(text: str) -> list[str]:
    """The clean sentences of one passage (see the module docstring), in order."""
    lines = [ln.strip() for ln in text.replace("\u2019", "'").splitlines()]
    prose = " ".join(ln for ln in lines if ln and not re.match(r"^([#*\-\d]|>|\|)", ln))
    out, seen = [], set()
    for s in _SENTENCE_END.split(prose):
        s = " ".join(s.split())
        if not s or s[-1] not in ".!?" or not _ALLOWED.match(s) or not 3 <= len(s.split()) <= 40:
            continue
        if ".." in s or any(not _HAS_LETTER.search(w) for w in s.split()):  # ellipses, a lone "-"
            continue
        if s.lower() in seen:
            continue
        seen.add(s.lower())
        out.append(s)
    return out


@lru_cache(maxsize=None)
def split_sentences(split: str, corpus: str = str(CORPUS)) -> tuple[tuple[str, ...], ...]:
    """Per passage of `split`, in file order, its clean sentences (passages with none are skipped)."""
    if split not in SPLITS:
        raise ValueError(f"natural-text split must be one of {sorted(SPLITS)}, got {split!r}")
    path = Path(corpus)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: it ships with wnw-exp (regenerate it with "
                                "`python -m wnw_exp.data.natural_text generate`)")
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if rec["split"] == split:
                s = sentences(rec["text"])
                if s:
                    out.append(tuple(s))
    if not out:
        raise ValueError(f"{path} holds no {split!r} passages")
    return tuple(out)


# --- generation (once, offline) ------------------------------------------------------------------------------
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
