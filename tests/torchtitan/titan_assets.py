"""The torchtitan test's own tokenizer and data, made on the spot (nothing comes from a model hub).

:func:`write_tokenizer` writes ``tokenizer.json`` (a Hugging Face ``tokenizers`` word-level tokenizer,
ids below 2048, the debug model's vocabulary size) and ``tokenizer_config.json`` (BOS/EOS tokens) in the
layout torchtitan's ``HuggingFaceTokenizer`` loads from ``--hf_assets_path``. :func:`write_dataset` writes
a ``train.jsonl`` of ``{"text": ...}`` rows, the shape of torchtitan's ``c4_test`` dataset, for
``--dataloader.dataset_path``. Both are deterministic (a fixed-seed generator), so every run of a test
sees the same tokens. Runs in the torchtitan venv (it needs ``tokenizers``) or anywhere for the data.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["BOS", "EOS", "write_dataset", "write_tokenizer"]

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
_WORDS = 500  # word-level vocabulary besides the special tokens


def _words() -> list[str]:
    return [f"w{i}" for i in range(_WORDS)]


def write_tokenizer(folder: Path) -> Path:
    """Write the tokenizer files into ``folder`` (created); returns ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate([BOS, EOS, "<unk>", *_words()])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def write_dataset(folder: Path, rows: int = 200, words_per_row: int = 80, seed: int = 0) -> Path:
    """Write ``rows`` documents of random vocabulary words to ``folder/train.jsonl``; returns ``folder``."""
    rng = random.Random(seed)
    words = _words()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "train.jsonl", "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(words_per_row))}) + "\n")
    return folder


if __name__ == "__main__":
    import sys

    root = Path(sys.argv[1])
    write_tokenizer(root / "tokenizer")
    write_dataset(root / "data")
