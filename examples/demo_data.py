"""The demo data set and its character-level tokenizer, shared by the examples in this folder."""
from __future__ import annotations

from pathlib import Path

import torch

DATA_FILE = Path(__file__).parent / "data" / "arithmetic.txt"
CHARS = "0123456789+=\n"
PAD = len(CHARS)  # padding id; labels at padding are -100
VOCAB_SIZE = len(CHARS) + 1
SEQ_LEN = 12  # longest line "99+99=198" plus newline, padded


def encode(line: str) -> list[int]:
    return [CHARS.index(c) for c in line + "\n"]


def load_split(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) ``[N, SEQ_LEN]`` for "train" (first 3,500 lines) or "eval" (the last 500)."""
    lines = DATA_FILE.read_text().split()
    lines = lines[:3500] if split == "train" else lines[3500:]
    ids = torch.full((len(lines), SEQ_LEN), PAD, dtype=torch.long)
    for row, line in enumerate(lines):
        tokens = encode(line)
        ids[row, : len(tokens)] = torch.tensor(tokens)
    labels = ids.masked_fill(ids == PAD, -100)
    return ids, labels


def answer_accuracy(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """Fraction of answer characters (after '=') predicted exactly by the next-token argmax."""
    predicted = logits[:, :-1].argmax(-1)
    target = ids[:, 1:]
    after_equals = (ids == CHARS.index("=")).long().cumsum(1)[:, :-1] > 0
    mask = after_equals & (target != PAD)
    return ((predicted == target) & mask).sum().item() / max(mask.sum().item(), 1)


def char_tokenizer():
    """A transformers tokenizer with the ids :func:`encode` gives (one token per character, newline ending a
    sequence, ``PAD`` padding), for trainers that tokenize text themselves (TRL's)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(CHARS)} | {"<pad>": PAD}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="\n", unk_token="<pad>")
