"""The training set: the corpora tokenized once into one Parquet file, cached by content hash (dataset_key,
build_token_dataset, prepare_dataset), read memory-mapped a row group at a time (TokenDataset), batched in a seeded
order that a resumed run continues exactly (BatchOrder) and padded into model inputs (collate); tokenize_corpus
tokenizes the held-out evaluation text.
"""
from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from edgeflow.tracking.artifacts import sha256_file, sha256_json
from edgeflow.profile import DistillConfig
from edgeflow.distill.checks import tokenizer_fingerprint
from edgeflow.calibration.textdata import read_records, record_text

logger = logging.getLogger("edgeflow.distill")

# Bump when the Parquet layout changes, so old caches are not read with new code.
DATA_FORMAT = 1


def dataset_key(corpora: list[Path], tokenizer, max_seq_len: int, max_truncation_ratio: float) -> str:
    """Content hash of what the training set is made from (file bytes, tokenizer, truncation)."""
    return sha256_json({
        "format": DATA_FORMAT,
        "corpora": [sha256_file(p) for p in corpora],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "max_seq_len": max_seq_len,
        # part of the key: a cached set was checked against the ratio it was built with
        "max_truncation_ratio": max_truncation_ratio,
    })


TOKEN_SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32())), ("n_tokens", pa.int32()), ("source", pa.int16()),
                          ("record", pa.int32()), ("truncated", pa.bool_())])


def build_token_dataset(corpora: list[Path], tokenizer, max_seq_len: int, max_truncation_ratio: float, out: Path,
                        key: str = "", row_group_size: int = 1024) -> dict:
    """Tokenize every record (rendered as the model sees it), truncate to max_seq_len and write one Parquet file.

    Refuses, naming the file, the record, its length and the fix:
    - a record with fewer than 2 tokens (nothing to predict; an empty record is a corpus bug);
    - a file whose every record has >= max_truncation_ratio x max_seq_len tokens: unsplit documents, of which
      training would see only the first max_seq_len tokens. A single over-long record among normal ones is
      truncated and counted, not refused.
    Returns the stats also stored in the file's metadata.
    """
    limit = max_truncation_ratio * max_seq_len
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    schema = TOKEN_SCHEMA
    stats = {"samples": 0, "truncated": 0, "overlong": 0, "tokens": 0, "files": [str(p) for p in corpora], "max_seq_len": max_seq_len}
    buf: dict[str, list] = {k: [] for k in schema.names}

    def flush(writer: pq.ParquetWriter) -> None:
        if buf["input_ids"]:
            writer.write_table(pa.table(buf, schema=schema))
            for v in buf.values():
                v.clear()

    try:
        # uncompressed: the file is memory-mapped at training time and read a row group at a time
        with pq.ParquetWriter(tmp, schema, compression="none") as writer:
            for src, path in enumerate(corpora):
                texts = [record_text(r, tokenizer) for r in read_records(path)]
                over_in_file, first_over = 0, None
                for start in range(0, len(texts), 256):
                    encoded = tokenizer(texts[start : start + 256], add_special_tokens=False)["input_ids"]
                    for i, ids in enumerate(encoded, start):
                        n = len(ids)
                        if n < 2:
                            raise ValueError(
                                f"distill.corpora: {path} record #{i} (0-based) has {n} token(s) after rendering; a training "
                                "sample needs at least 2 (one to read, one to predict). Remove or fill that record (clean the corpus)."
                            )
                        if n >= limit:
                            over_in_file += 1
                            first_over = first_over or (i, n)
                        buf["input_ids"].append(ids[:max_seq_len])
                        buf["n_tokens"].append(min(n, max_seq_len))
                        buf["source"].append(src)
                        buf["record"].append(i)
                        buf["truncated"].append(n > max_seq_len)
                        stats["samples"] += 1
                        stats["truncated"] += n > max_seq_len
                        stats["tokens"] += min(n, max_seq_len)
                        if len(buf["input_ids"]) >= row_group_size:
                            flush(writer)
                if texts and over_in_file == len(texts):
                    i, n = first_over
                    raise ValueError(
                        f"distill.corpora: every one of the {len(texts)} records in {path} has at least "
                        f"{max_truncation_ratio:g} x max_seq_len = {limit:,.0f} tokens (record #{i} (0-based) has {n:,}): truncated to "
                        f"max_seq_len={max_seq_len}, training would see only the first {max_seq_len / n:.1%} of it. This looks like "
                        "unsplit documents: split the file into samples (clean the corpus) or raise distill.max_seq_len "
                        "(distill.max_truncation_ratio only if truncating this much is intended)."
                    )
                stats["overlong"] += over_in_file
            flush(writer)
            writer.add_key_value_metadata({"edgeflow": json.dumps(stats | {"key": key})})
        if stats["samples"] == 0:
            raise ValueError(f"distill.corpora {[str(p) for p in corpora]} hold no records; name at least one non-empty training file")
        tmp.rename(out)
    finally:
        tmp.unlink(missing_ok=True)
    return stats


class TokenDataset:
    """Training sequences read from the memory-mapped Parquet file, one row group at a time (a few cached)."""

    def __init__(self, path: Path, cache_row_groups: int = 4):
        self.path = Path(path)
        self._file = pq.ParquetFile(pa.memory_map(str(self.path), "r"))
        md = self._file.metadata
        self.stats = json.loads(md.metadata[b"edgeflow"]) if md.metadata and b"edgeflow" in md.metadata else {}
        sizes = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
        self._starts = np.cumsum([0] + sizes)
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._cache_size = cache_row_groups

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _group(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        if g in self._cache:
            self._cache.move_to_end(g)
            return self._cache[g]
        col = self._file.read_row_group(g, columns=["input_ids"]).column(0).combine_chunks()
        entry = (col.offsets.to_numpy(), col.values.to_numpy())
        self._cache[g] = entry
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return entry

    def __getitem__(self, i: int) -> list[int]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        g = int(np.searchsorted(self._starts, i, side="right") - 1)
        offsets, values = self._group(g)
        j = i - int(self._starts[g])
        return values[offsets[j] : offsets[j + 1]].tolist()


def prepare_dataset(corpora: list[Path], tokenizer, cfg: DistillConfig, cache_dir: Path) -> tuple[TokenDataset, dict]:
    """The training set for these inputs: built once, then found by content hash under cache_dir."""
    key = dataset_key(corpora, tokenizer, cfg.max_seq_len, cfg.max_truncation_ratio)
    path = cache_dir / f"{key[:32]}.parquet"
    hit = path.exists()
    if not hit:
        build_token_dataset(corpora, tokenizer, cfg.max_seq_len, cfg.max_truncation_ratio, path, key=key)
    data = TokenDataset(path)
    s = data.stats
    logger.info("training set %s: %d samples, %d truncated to %d tokens%s", path, s["samples"], s["truncated"],
                cfg.max_seq_len, " (cached)" if hit else "")
    return data, {"training_sequences": s["samples"], "truncated_samples": s["truncated"], "overlong_samples": s["overlong"],
                  "training_tokens": s["tokens"], "dataset_cache_hit": int(hit), "dataset_key": key}


def tokenize_corpus(texts: list[str], tokenizer, max_seq_len: int) -> tuple[list[list[int]], int]:
    """Token ids per text, truncated to max_seq_len; returns (ids, number truncated). Texts under 2 tokens are dropped."""
    ids, truncated = [], 0
    for t in texts:
        toks = tokenizer(t, add_special_tokens=False)["input_ids"]
        if len(toks) > max_seq_len:
            truncated += 1
            toks = toks[:max_seq_len]
        if len(toks) >= 2:
            ids.append(toks)
    return ids, truncated


class BatchOrder:
    """Which samples make step s's batch: a pure function of (seed, step), so a resumed run continues exactly.

    Each epoch is a fresh seeded permutation; the global batch of `batch_size` is split across ranks by
    striding (rank r takes positions r, r+world, …), as torch's DistributedSampler does.
    """

    def __init__(self, n: int, batch_size: int, seed: int):
        if n < 1:
            raise ValueError("the training set is empty")
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            if len(self._perms) > 2:
                self._perms.popitem(last=False)
        return self._perms[epoch]

    def indices(self, step: int, rank: int = 0, world_size: int = 1) -> list[int]:
        """Sample indices of this rank's share of step `step`'s global batch."""
        first = step * self.batch_size
        positions = range(first + rank, first + self.batch_size, world_size)
        return [int(self._perm(p // self.n)[p % self.n]) for p in positions]


def collate(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) right-padded; labels are shifted so position t predicts token t+1."""
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
    labels = input_ids.clone()
    labels[attn == 0] = -100
    labels = torch.cat([labels[:, 1:], torch.full((len(seqs), 1), -100)], dim=1)
    return input_ids, attn, labels

