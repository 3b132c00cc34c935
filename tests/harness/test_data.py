"""Data: documents, tokenization, packing, data-parallel sharding and resumable position."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from trnkit.harness.config import ConfigError, DataConfig
from trnkit.harness.data import (PackedLoader, build_loader, load_tokenizer, read_documents, shakespeare_files,
                                 tokenize_stream)


def test_bundled_qwen3_tokenizer_matches_published_ids() -> None:
    tok = load_tokenizer("qwen3")
    # reference ids for the published Qwen3 tokenizer.json (shared/notes/packages.md)
    assert tok.encode("Hello world! Qwen3 MoE on Trainium 你好") == [
        9707, 1879, 0, 1207, 16948, 18, 6050, 36, 389, 26125, 2356, 220, 108386]
    assert tok.eos_id == 151643 and tok.vocab_size == 151669


def test_bundled_corpus() -> None:
    files = shakespeare_files()
    assert len(files) == 38 and all(f.endswith(".md") for f in files)


def test_packing_windows_overlap_by_one() -> None:
    stream = np.arange(100, dtype=np.int64)
    loader = PackedLoader(stream, seq_len=8, local_batch_size=3)
    assert loader.num_samples == (100 - 1) // 8
    b = loader.next_batch()
    assert b.tokens.tolist() == [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    assert b.labels.tolist() == [list(range(1, 9)), list(range(9, 17)), list(range(17, 25))]
    assert loader.position == 3


@pytest.mark.parametrize("shuffle", [False, True])
def test_dp_shards_partition_the_global_batch(shuffle: bool) -> None:
    stream = np.random.default_rng(0).integers(0, 50, 1000)
    single = PackedLoader(stream, 16, local_batch_size=4, shuffle=shuffle, seed=3)
    ranks = [PackedLoader(stream, 16, local_batch_size=2, dp_rank=r, dp_degree=2, shuffle=shuffle, seed=3)
             for r in range(2)]
    for _ in range(20):  # crosses the epoch boundary (62 samples)
        full = single.next_batch()
        parts = [r.next_batch() for r in ranks]
        assert torch.equal(full.tokens, torch.cat([p.tokens for p in parts]))
        assert torch.equal(full.labels, torch.cat([p.labels for p in parts]))
    assert single.position == ranks[0].position == ranks[1].position == 80
    assert single.epoch == 1


def test_resume_position_is_exact() -> None:
    stream = np.arange(500, dtype=np.int64)
    a = PackedLoader(stream, 10, 2)
    for _ in range(3):
        a.next_batch()
    b = PackedLoader(stream, 10, 2)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.next_batch().tokens, b.next_batch().tokens)


@pytest.mark.parametrize("other, names", [
    (dict(seq_len=12), "training.seq_len: checkpoint 10, this run 12"),
    (dict(shuffle=False), "data.shuffle: checkpoint True, this run False"),
    (dict(seed=7), "job.seed: checkpoint 0, this run 7"),
    (dict(stream=np.arange(400, dtype=np.int64)), "the training corpus: checkpoint 49 samples of 10 tokens, this "
     "run 39 (data.dataset, data.tokenizer, data.add_eos, data.max_documents or validation.split_fraction changed)"),
])
def test_resume_into_other_data_names_the_settings(other: dict, names: str) -> None:
    """A data position means other samples under another seq_len, order or corpus: refused, naming the keys."""
    a = PackedLoader(np.arange(500, dtype=np.int64), 10, 2, shuffle=True, seed=0)
    a.next_batch()
    kw = {"stream": np.arange(500, dtype=np.int64), "seq_len": 10, "shuffle": True, "seed": 0, **other}
    b = PackedLoader(kw.pop("stream"), kw.pop("seq_len"), 2, **kw)
    with pytest.raises(ConfigError) as exc:
        b.load_state_dict(a.state_dict())
    assert str(exc.value) == (f"data: the checkpoint's data position reads other samples in this run ({names}). "
                              "Resume with the checkpoint's settings (see its run's config.toml), or use another "
                              "--job.dump_folder")
    assert b.position == 0


def test_documents_txt_jsonl_and_eos(tmp_path: Path, tiny_tokenizer: str) -> None:
    (tmp_path / "a.txt").write_text("To be, or not to be")
    rows = [{"text": "that is the question"}, {"text": "whether 'tis nobler"}]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    docs = read_documents(str(tmp_path))
    assert docs == ["To be, or not to be", "that is the question", "whether 'tis nobler"]
    assert read_documents(str(tmp_path), max_documents=2) == docs[:2]
    tok = load_tokenizer(tiny_tokenizer)
    stream = tokenize_stream(docs, tok, add_eos=True)
    expect = [t for d in docs for t in tok.encode(d) + [tok.eos_id]]
    assert stream.tolist() == expect
    assert tok.decode(tok.encode(docs[0])) == docs[0]


def test_data_errors(tmp_path: Path, tiny_tokenizer: str) -> None:
    with pytest.raises(ConfigError, match="no .txt/.md/.jsonl/.parquet files found"):
        read_documents(str(tmp_path / "nothing"))
    (tmp_path / "x.jsonl").write_text('{"body": "hi"}\n')
    with pytest.raises(ConfigError, match=r"x.jsonl:1 has no field 'text' \(fields: \['body'\]\)"):
        read_documents(str(tmp_path / "x.jsonl"))
    with pytest.raises(ConfigError, match="no tokenizer.json at"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "y.txt").write_text("short")
    cfg = DataConfig(tokenizer=tiny_tokenizer, dataset=str(tmp_path / "y.txt"))
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        build_loader(cfg, seq_len=64, local_batch_size=4, dp_rank=0, dp_degree=1)
    (tmp_path / "empty.txt").write_text("")  # without EOS: no token at all (the message said '-1 samples')
    cfg = DataConfig(tokenizer=tiny_tokenizer, dataset=str(tmp_path / "empty.txt"), add_eos=False)
    with pytest.raises(ConfigError, match=r"^data: the corpus has 0 tokens = 0 samples of seq_len 64, fewer than one "
                                          r"global batch \(4\)"):
        build_loader(cfg, seq_len=64, local_batch_size=4, dp_rank=0, dp_degree=1)


def test_parquet_needs_pyarrow_or_reads(tmp_path: Path) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        (tmp_path / "d.parquet").write_bytes(b"PAR1")
        with pytest.raises(ConfigError, match="needs pyarrow"):
            read_documents(str(tmp_path / "d.parquet"))
        return
    pq.write_table(pa.table({"text": ["a b", "c"]}), tmp_path / "d.parquet")
    assert read_documents(str(tmp_path / "d.parquet")) == ["a b", "c"]


def test_shuffle_is_a_seeded_permutation_per_epoch() -> None:
    stream = np.arange(8 * 10 + 1, dtype=np.int64)  # 10 samples of 8
    loader = PackedLoader(stream, 8, 1, shuffle=True, seed=7)
    epoch0 = [loader.sample_index(p) for p in range(10)]
    epoch1 = [loader.sample_index(p) for p in range(10, 20)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))  # every sample once per epoch
    assert epoch0 != list(range(10)) and epoch0 != epoch1
    assert epoch0 == list(np.random.default_rng([7, 0]).permutation(10))
    b = loader.next_batch()
    assert b.tokens[0].tolist() == list(range(8 * epoch0[0], 8 * epoch0[0] + 8))
    other = PackedLoader(stream, 8, 1, shuffle=True, seed=8)
    with pytest.raises(ConfigError, match=r"\(job\.seed: checkpoint 7, this run 8\)"):
        other.load_state_dict(loader.state_dict())
