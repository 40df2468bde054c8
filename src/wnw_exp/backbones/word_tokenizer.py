"""Word-level tokenizer for the small speech LLMs of this project (`tiny`, `tiny_random`).

The special tokens mirror the Voxtral/Mistral transcription prompt
(`<s>[INST][BEGIN_AUDIO][AUDIO]...[/INST][TRANSCRIBE]`) so the tiny models go through the same
prompt structure as Voxtral-Mini-3B; the words are `wnw_exp.vocabulary` (the synthetic data set speaks the same).
"""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers, decoders
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[BEGIN_AUDIO]", "[AUDIO]", "[TRANSCRIBE]", "<pad>"]
UNK, BOS, EOS, INST, END_INST, BEGIN_AUDIO, AUDIO, TRANSCRIBE, PAD = range(len(SPECIAL_TOKENS))


def build_word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer: ids 0-8 are the special tokens, then `words` in order."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for w in words:
        if w not in vocab:
            vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins word tokens with single spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[3:8],
    )


def transcription_prompt(n_audio_tokens: int) -> list[int]:
    """Prompt ids `<s>[INST][BEGIN_AUDIO][AUDIO]*n[/INST][TRANSCRIBE]`; the answer follows, then `</s>`."""
    return [BOS, INST, BEGIN_AUDIO] + [AUDIO] * n_audio_tokens + [END_INST, TRANSCRIBE]
