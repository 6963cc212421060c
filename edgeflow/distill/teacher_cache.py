"""The teacher-output cache: the frozen teacher's top-k log-probabilities (and the mapped layers' hidden states) per
training sequence, computed once and reused by every later distillation of the same teacher, on any host.

    python -m edgeflow.distill.teacher_cache .edgeflow/demo-cpu/cache/teacher-outputs     (what each namespace holds)

Why: the teacher forward is the one cost of distillation that does not change between runs of the same teacher and
corpus (a 27B teacher's forward dominates the A100 run; on the 135M demo teacher it is about a third of a step), and
a new student size, learning rate, step count or seed needs the same teacher outputs again.

What is stored, per sequence (a row of a Parquet shard):
- `topk_idx`/`topk_logp`: for every position, the teacher's k most likely next tokens and their log-probabilities at the
  distillation temperature, log_softmax(z / T) over the whole vocabulary (float32, so a cached step and a live one
  compute the same loss; the KD term over the top k plus the rest is edgeflow/distill/losses.py:kd_sums_topk);
- `hidden`: the hidden states of the teacher layers the student's hidden-state term matches (beta > 0), in bfloat16.

Keys, by content only:
- the namespace (a directory locally, an MLflow run tag in the store) is the hash of the teacher's weights (tree
  sha256), k, the temperature, the hidden-state dtype, the precision the teacher ran in (fp32, or bf16 under
  distill.mixed_precision) and the storage format: a changed teacher, k, T or precision reads nothing old;
- an entry is the hash of the sequence's token ids (int32 bytes), so a corpus edit, a new tokenizer or another
  max_seq_len misses exactly the sequences whose tokens changed, and every unchanged one still hits;
- an entry serves a run only when it holds every teacher layer that run matches (a student keeping other layers
  misses).

A run that misses computes the teacher on the missing sequences only, trains on those outputs rounded exactly as
they are stored (a cache hit and a miss give the same step), and writes them to a new shard named by its sha256.
Hosts share nothing but MLflow: `pull` fetches every shard of a namespace from the experiment
`edgeflow-teacher-outputs` (by URI, checked against the sha256 its name carries; edgeflow/tracking/store.py), `push` logs this
host's new shards there.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from edgeflow.tracking.artifacts import ArtifactRef, sha256_file, sha256_json
from edgeflow.distill.losses import teacher_topk

logger = logging.getLogger("edgeflow.distill")

# Bump when the shard layout or what a row means changes: a new format is a new namespace.
CACHE_FORMAT = 1
EXPERIMENT = "edgeflow-teacher-outputs"
NAMESPACE_TAG = "edgeflow.teacher_cache"
SHARD_DIR = "shards"
# Rows per Parquet row group: a step reads a handful of sequences in random order, so a row group is one sequence
# plus its neighbours' few MB at most (24 mapped layers x 128 tokens x 576 x 2 B = 3.5 MB a sequence on the demo).
ROW_GROUP = 4

SCHEMA = pa.schema([
    ("key", pa.string()), ("n", pa.int32()), ("k", pa.int32()), ("width", pa.int32()),
    ("layers", pa.list_(pa.int32())), ("topk_idx", pa.binary()), ("topk_logp", pa.binary()), ("hidden", pa.binary()),
])
_HIDDEN_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class CacheSpec:
    """What the stored outputs depend on besides the sequence itself (the namespace)."""

    teacher_sha256: str
    top_k: int
    temperature: float
    hidden_dtype: str = "bfloat16"
    precision: str = "fp32"  # what the teacher's forward computed in (distill.mixed_precision, resolved on the host)

    @property
    def namespace(self) -> str:
        return sha256_json({"format": CACHE_FORMAT, "teacher": self.teacher_sha256, "top_k": self.top_k,
                            "temperature": float(self.temperature), "hidden_dtype": self.hidden_dtype,
                            "precision": self.precision})[:32]

    def tags(self) -> dict[str, str]:
        return {NAMESPACE_TAG: self.namespace, "edgeflow.teacher_sha256": self.teacher_sha256,
                "edgeflow.top_k": str(self.top_k), "edgeflow.temperature": repr(float(self.temperature)),
                "edgeflow.hidden_dtype": self.hidden_dtype, "edgeflow.precision": self.precision,
                "edgeflow.cache_format": str(CACHE_FORMAT)}


def sequence_key(ids: Sequence[int]) -> str:
    """Content key of one training sequence: the hash of its token ids."""
    return hashlib.sha256(np.asarray(ids, dtype=np.int32).tobytes()).hexdigest()[:32]


def bytes_per_token(top_k: int, hidden_layers: int, hidden_size: int) -> int:
    """Stored bytes per token: k int32 indices + k float32 log-probabilities + the mapped layers' 2-byte states."""
    return top_k * 8 + hidden_layers * hidden_size * 2


@dataclass
class _Entry:
    idx: np.ndarray        # [n, k] int32
    logp: np.ndarray       # [n, k] float32
    hidden: dict[int, np.ndarray]  # teacher layer -> [n, width] uint16 (the 2-byte float's bits)


@dataclass
class _Location:
    shard: Path
    row: int
    layers: frozenset[int]


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    shards_read: int = 0
    shards_written: list[str] = field(default_factory=list)
    bytes_written: int = 0


class TeacherCache:
    """One namespace of teacher outputs on this host: its shards under `root/<namespace>/`, and what this run adds."""

    def __init__(self, root: Path, spec: CacheSpec):
        if spec.hidden_dtype not in _HIDDEN_DTYPES:
            raise ValueError(f"teacher cache hidden_dtype={spec.hidden_dtype!r}; choose one of {sorted(_HIDDEN_DTYPES)}")
        self.spec = spec
        self.dir = Path(root) / spec.namespace
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stats = CacheStats()
        self._index: dict[str, list[_Location]] = {}
        self._files: dict[Path, pq.ParquetFile] = {}
        self._groups: OrderedDict[tuple[Path, int], pa.Table] = OrderedDict()
        self._pending: dict[str, _Entry] = {}
        for shard in sorted(self.dir.glob("*.parquet")):
            self._add_shard(shard)

    # --- reading
    def _add_shard(self, shard: Path) -> None:
        table = pq.read_table(shard, columns=["key", "layers"])
        for row, (key, layers) in enumerate(zip(table.column("key").to_pylist(), table.column("layers").to_pylist())):
            self._index.setdefault(key, []).append(_Location(shard, row, frozenset(layers)))
        self.stats.shards_read += 1

    def __len__(self) -> int:
        return len(self._index)

    def _row(self, loc: _Location) -> dict[str, Any]:
        f = self._files.get(loc.shard)
        if f is None:
            f = self._files[loc.shard] = pq.ParquetFile(pa.memory_map(str(loc.shard), "r"))
        group, offset = divmod(loc.row, ROW_GROUP)
        cached = self._groups.get((loc.shard, group))
        if cached is None:
            cached = self._groups[(loc.shard, group)] = f.read_row_group(group)
            if len(self._groups) > 8:
                self._groups.popitem(last=False)
        return cached.slice(offset, 1).to_pylist()[0]

    def _lookup(self, key: str, layers: Sequence[int]) -> _Entry | None:
        pending = self._pending.get(key)
        if pending is not None and set(layers) <= set(pending.hidden):
            return pending
        for loc in self._index.get(key, ()):
            if set(layers) <= loc.layers:
                r = self._row(loc)
                n, k, w = r["n"], r["k"], r["width"]
                hidden = np.frombuffer(r["hidden"], dtype=np.uint16).reshape(len(r["layers"]), n, w) if r["layers"] else None
                return _Entry(np.frombuffer(r["topk_idx"], dtype=np.int32).reshape(n, k),
                              np.frombuffer(r["topk_logp"], dtype=np.float32).reshape(n, k),
                              {t: hidden[i] for i, t in enumerate(r["layers"])} if hidden is not None else {})
        return None

    # --- what a training step asks for
    @torch.no_grad()
    def outputs(self, teacher, seqs: list[list[int]], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The batch's teacher outputs: (top-k indices [B, W, k], log-probabilities [B, W, k], the mapped layers'
        hidden states [B, W, d] each, float32), from the cache, the teacher computing only the sequences it misses.

        `seqs` are the batch's token ids (input_ids/attention_mask their right-padded collation). Padding positions
        hold index 0 and log-probability 0; the loss masks them.
        """
        layers = sorted(layers)
        keys = [sequence_key(s) for s in seqs]
        found = [self._lookup(k, layers) for k in keys]
        missing = [i for i, e in enumerate(found) if e is None]
        if missing:
            live = self._compute(teacher, [seqs[i] for i in missing], input_ids[missing], attention_mask[missing], layers)
            for i, entry in zip(missing, live):
                found[i] = self._pending[keys[i]] = entry
        self.stats.hits += len(seqs) - len(missing)
        self.stats.misses += len(missing)
        b, w = input_ids.shape
        k = found[0].idx.shape[1]
        idx = torch.zeros((b, w, k), dtype=torch.int64)
        logp = torch.zeros((b, w, k), dtype=torch.float32)
        dtype = _HIDDEN_DTYPES[self.spec.hidden_dtype]
        hidden = [torch.zeros((b, w, self._width(found, t)), dtype=torch.float32) for t in layers]
        for i, e in enumerate(found):
            n = len(seqs[i])
            idx[i, :n] = torch.from_numpy(e.idx.astype(np.int64))
            logp[i, :n] = torch.from_numpy(e.logp.copy())
            for j, t in enumerate(layers):
                hidden[j][i, :n] = torch.from_numpy(e.hidden[t].astype(np.int16)).view(dtype).float()
        device = input_ids.device
        return idx.to(device), logp.to(device), [h.to(device) for h in hidden]

    @staticmethod
    def _width(found: list[_Entry], layer: int) -> int:
        return found[0].hidden[layer].shape[1]

    def _compute(self, teacher, seqs: list[list[int]], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 layers: list[int]) -> list[_Entry]:
        out = teacher(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=bool(layers), use_cache=False)
        idx, logp = teacher_topk(out.logits, self.spec.temperature, self.spec.top_k)
        dtype = _HIDDEN_DTYPES[self.spec.hidden_dtype]
        # hidden_states[0] is the embedding output; hidden_states[t + 1] is decoder layer t's output
        states = {t: out.hidden_states[t + 1].to(dtype).view(torch.int16).cpu().numpy().view(np.uint16) for t in layers}
        idx, logp = idx.to(torch.int32).cpu().numpy(), logp.cpu().numpy()
        entries = []
        for i, s in enumerate(seqs):
            n = len(s)
            entries.append(_Entry(np.ascontiguousarray(idx[i, :n]), np.ascontiguousarray(logp[i, :n]),
                                  {t: np.ascontiguousarray(states[t][i, :n]) for t in layers}))
        return entries

    # --- writing
    def flush(self) -> Path | None:
        """Write what this run computed to a new shard named by its sha256 (None when nothing is new)."""
        if not self._pending:
            return None
        rows: dict[str, list] = {name: [] for name in SCHEMA.names}
        for key, e in self._pending.items():
            layers = sorted(e.hidden)
            rows["key"].append(key)
            rows["n"].append(e.idx.shape[0])
            rows["k"].append(e.idx.shape[1])
            rows["width"].append(e.hidden[layers[0]].shape[1] if layers else 0)
            rows["layers"].append(layers)
            rows["topk_idx"].append(e.idx.tobytes())
            rows["topk_logp"].append(e.logp.tobytes())
            rows["hidden"].append(np.stack([e.hidden[t] for t in layers]).tobytes() if layers else b"")
        tmp = self.dir / f".pending-{os.getpid()}-{uuid.uuid4().hex[:8]}.parquet.tmp"
        try:
            # uncompressed: bfloat16 states and log-probabilities barely compress, and the file is memory-mapped
            pq.write_table(pa.table(rows, schema=SCHEMA), tmp, compression="none", row_group_size=ROW_GROUP)
            sha = sha256_file(tmp)
            shard = self.dir / f"{sha}.parquet"
            os.replace(tmp, shard)
        finally:
            tmp.unlink(missing_ok=True)
        self.stats.shards_written.append(shard.name)
        self.stats.bytes_written += shard.stat().st_size
        self._pending.clear()
        self._add_shard(shard)
        self.stats.shards_read -= 1  # written here, not read
        return shard

    def metrics(self) -> dict[str, float]:
        s = self.stats
        return {"teacher_cache_hits": s.hits, "teacher_cache_misses": s.misses, "teacher_cache_shards_read": s.shards_read,
                "teacher_cache_bytes_written": s.bytes_written}


# --- the store: one MLflow run per namespace in EXPERIMENT, its shards under shards/<sha256>.parquet. `spec` is any
# object with a `namespace` and `tags()`: a CacheSpec here, an AnswersSpec for sequence-level KD (edgeflow/distill/seqkd.py).
def _runs(client, spec: CacheSpec, create: bool, artifact_location: str | None = None) -> list:
    from edgeflow.tracking.runs import experiment_id, find_experiment_id

    exp = experiment_id(client, EXPERIMENT, artifact_location) if create else find_experiment_id(client, EXPERIMENT)
    if exp is None:
        return []
    runs = client.search_runs([exp], f"tags.`{NAMESPACE_TAG}` = '{spec.namespace}'", max_results=1000,
                              order_by=["attributes.start_time ASC"])
    if runs or not create:
        return list(runs)
    run = client.create_run(exp, tags=spec.tags(), run_name=f"teacher-outputs-{spec.namespace[:12]}")
    client.set_terminated(run.info.run_id)  # a store of files, not a job: its artifacts are added later
    return [client.get_run(run.info.run_id)]


def _store_shards(client, run) -> list[ArtifactRef]:
    base = run.info.artifact_uri.rstrip("/")
    refs = []
    for f in client.list_artifacts(run.info.run_id, SHARD_DIR) or []:
        name = f.path.rsplit("/", 1)[-1]
        if name.endswith(".parquet") and not f.is_dir:
            refs.append(ArtifactRef(kind="teacher-outputs", uri=f"{base}/{SHARD_DIR}/{name}", sha256=name.removesuffix(".parquet"),
                                    mlflow_run_id=run.info.run_id))
    return refs


def pull(client, spec: CacheSpec, root: Path) -> int:
    """Fetch every shard of the namespace from the store that this host lacks (each checked by its sha256);
    returns how many were fetched."""
    from edgeflow.tracking.store import link_or_copy, materialize

    local = Path(root) / spec.namespace
    local.mkdir(parents=True, exist_ok=True)
    fetched = 0
    for run in _runs(client, spec, create=False):
        for ref in _store_shards(client, run):
            dest = local / ref.name
            if not dest.exists():
                link_or_copy(materialize(ref), dest)
                fetched += 1
    return fetched


def push(client, spec: CacheSpec, root: Path, artifact_location: str | None = None) -> list[ArtifactRef]:
    """Log this host's shards of the namespace that the store lacks; returns their references."""
    from edgeflow.tracking.store import publish

    local = Path(root) / spec.namespace
    shards = sorted(local.glob("*.parquet")) if local.is_dir() else []
    if not shards:
        return []
    runs = _runs(client, spec, create=True, artifact_location=artifact_location)
    have = {r.name for run in runs for r in _store_shards(client, run)}
    return [publish(client, runs[0].info.run_id, s, SHARD_DIR, "teacher-outputs", sha256=s.stem)
            for s in shards if s.name not in have]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="What a teacher-output cache directory holds, per namespace.")
    parser.add_argument("root", type=Path, help="<work>/cache/teacher-outputs")
    root = parser.parse_args(argv).root
    for ns in sorted(p for p in root.iterdir() if p.is_dir()):
        shards = sorted(ns.glob("*.parquet"))
        rows = sum(pq.ParquetFile(s).metadata.num_rows for s in shards)
        print(json.dumps({"namespace": ns.name, "shards": len(shards), "sequences": rows,
                          "bytes": sum(s.stat().st_size for s in shards)}))


if __name__ == "__main__":
    main()
