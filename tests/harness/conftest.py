"""Shared fixtures for the trainer tests: a small corpus and a tiny BPE tokenizer trained on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from trnkit.harness.data import shakespeare_files


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two Shakespeare plays (first 40 kB of each) as .txt files."""
    d = tmp_path_factory.mktemp("corpus")
    for i, f in enumerate(shakespeare_files()[:2]):
        (d / f"play{i}.txt").write_text(Path(f).read_text()[:40_000])
    return d


@pytest.fixture(scope="session")
def tiny_tokenizer(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A byte-level BPE with 384 tokens (incl. <|endoftext|>) trained on the corpus; its tokenizer.json path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(p) for p in sorted(corpus_dir.glob("*.txt"))], trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


