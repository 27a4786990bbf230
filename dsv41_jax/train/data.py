"""Training data: text / JSONL documents -> tokens -> fixed-length rows -> batches, deterministic and resumable.

* Input: files or directories (searched recursively with ``glob``). ``*.jsonl`` files hold one JSON object per line
  (the ``text_key`` field, default ``"text"``) or one JSON string per line; any other file is one document
  (UTF-8, undecodable bytes replaced; binary files — a NUL byte in the first 8 KiB — skipped).
* Tokenizer: an HF ``tokenizer.json`` (:class:`dsv41_jax.tokenizer.HFTokenizer`) or the byte-level fallback. Every
  document becomes ``[bos] + tokens + [eos]``.
* Packing (``TrainConfig.packing``) into rows of ``seq_len`` inputs with their next-token targets:
  ``concat`` — the documents of an epoch, shuffled, form one stream cut into rows (attention crosses documents,
  as in plain LM pre-training); ``pad`` — one document piece per row, padding masked; ``segments`` — pieces packed
  back to back with segment ids, so attention windows, compressor groups, the indexer and Engram n-grams restart at
  each document, and no target crosses a document boundary.
* Order: epoch ``e`` shuffles documents (and rows) with ``numpy.random.default_rng([seed, e])``. A position is
  ``{"epoch", "row"}``: the batch at a position depends on nothing else, so resuming from a saved position replays
  exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import os
import queue
import threading
from typing import Iterator, Sequence

import numpy as np


class DataError(ValueError):
    pass


# ----------------------------------------------------------------------------------------------------------------
# documents
# ----------------------------------------------------------------------------------------------------------------

def list_files(paths: Sequence[str], glob: str = "*", exclude: str = "") -> list[str]:
    """Files under ``paths`` (files as given; directories recursively, names matching any ``glob`` pattern, which
    may be comma-separated; directories whose name matches an ``exclude`` pattern are skipped), in a stable sorted
    order. Missing paths raise :class:`FileNotFoundError`."""
    patterns = [g.strip() for g in glob.split(",") if g.strip()] or ["*"]
    skip = [g.strip() for g in exclude.split(",") if g.strip()]
    out: list[str] = []
    if isinstance(paths, str):
        paths = [paths]
    for p in paths:
        if not os.path.exists(p):
            raise FileNotFoundError(f"training data not found: {p}")
        if os.path.isfile(p):
            out.append(p)
            continue
        found = []
        for root, dirs, files in os.walk(p):
            dirs[:] = sorted(d for d in dirs if not any(fnmatch.fnmatch(d, pat) for pat in skip))
            for f in sorted(files):
                full = os.path.join(root, f)
                if any(fnmatch.fnmatch(f, pat) for pat in patterns) and os.path.isfile(full):  # no broken links
                    found.append(full)
        out.extend(found)
    return out


def _is_binary(path: str) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(8192)


def _read_text(path: str, report: "ReadReport") -> str:
    """UTF-8 text of a file; invalid bytes are replaced and the file is counted in ``report.undecodable``."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        report.undecodable.append(path)
        return raw.decode("utf-8", errors="replace")


@dataclasses.dataclass
class ReadReport:
    """What :func:`read_documents` read and skipped (``dsv41 train`` prints it)."""

    files: int = 0  # files that matched
    documents: int = 0
    binary: list = dataclasses.field(default_factory=list)  # skipped: a NUL byte in the first 8 KiB
    undecodable: list = dataclasses.field(default_factory=list)  # read with invalid UTF-8 bytes replaced
    empty: int = 0  # files (or JSONL lines) with no text

    def describe(self) -> str:
        parts = [f"{self.documents:,} document(s) from {self.files:,} file(s)"]
        if self.binary:
            parts.append(f"{len(self.binary):,} binary file(s) skipped (e.g. {self.binary[0]})")
        if self.undecodable:
            parts.append(f"{len(self.undecodable):,} file(s) with invalid UTF-8, bytes replaced "
                         f"(e.g. {self.undecodable[0]})")
        if self.empty:
            parts.append(f"{self.empty:,} empty")
        return "; ".join(parts)


def read_documents(paths: Sequence[str], *, glob: str = "*", text_key: str = "text",
                   max_docs: int | None = None, exclude: str = "", report: ReadReport | None = None) -> list[str]:
    """Documents (strings) from text / JSONL files and directories; empty documents are dropped. Skipped binary
    files and files with invalid UTF-8 are counted in ``report`` (and named in the empty-corpus error)."""
    docs: list[str] = []
    report = report if report is not None else ReadReport()
    files = list_files(paths, glob, exclude)
    report.files = len(files)
    for path in files:
        if path.endswith(".jsonl"):
            for lineno, line in enumerate(_read_text(path, report).split("\n"), 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
                if isinstance(obj, str):
                    text = obj
                elif isinstance(obj, dict) and isinstance(obj.get(text_key), str):
                    text = obj[text_key]
                else:
                    raise DataError(f"{path}:{lineno}: expected a JSON string or an object with a string "
                                    f"field {text_key!r}")
                if text:
                    docs.append(text)
                else:
                    report.empty += 1
        else:
            if _is_binary(path):
                report.binary.append(path)
                continue
            text = _read_text(path, report)
            if text:
                docs.append(text)
            else:
                report.empty += 1
        if max_docs is not None and len(docs) >= max_docs:
            docs = docs[:max_docs]
            break
    report.documents = len(docs)
    if not docs:
        what = ", ".join(paths) if not isinstance(paths, str) else paths
        skipped = f": {report.describe()}" if files else ""
        raise DataError(f"empty corpus: no non-empty documents in {what} "
                        f"({len(files)} file(s) matched glob {glob!r}{skipped})")
    return docs


@dataclasses.dataclass
class TokenizedCorpus:
    tokens: np.ndarray  # int32, all documents back to back (each [bos] ... [eos])
    offsets: np.ndarray  # int64 [n_docs + 1]
    pad_id: int

    @property
    def n_docs(self) -> int:
        return len(self.offsets) - 1

    def doc(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    def fingerprint(self) -> str:
        h = hashlib.sha1()
        h.update(np.ascontiguousarray(self.tokens).tobytes())
        h.update(np.ascontiguousarray(self.offsets).tobytes())
        return h.hexdigest()[:16]


def tokenize_documents(docs: Sequence[str], tokenizer, *, model_vocab_size: int | None = None) -> TokenizedCorpus:
    from dsv41_jax.tokenizer import ByteTokenizer

    if model_vocab_size is not None and tokenizer.vocab_size > model_vocab_size:
        raise DataError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary has "
                        f"{model_vocab_size}")
    parts = []
    for text in docs:
        if isinstance(tokenizer, ByteTokenizer):  # fast path: bytes + offset
            body = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + ByteTokenizer.BYTE_OFFSET
        else:
            body = np.asarray(tokenizer.encode(text), np.int32)
        parts.append(np.concatenate([[tokenizer.bos_id], body, [tokenizer.eos_id]]).astype(np.int32))
    lengths = np.array([len(p) for p in parts], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return TokenizedCorpus(np.concatenate(parts), offsets, tokenizer.pad_id)


# ----------------------------------------------------------------------------------------------------------------
# rows and batches
# ----------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Rows:
    tokens: np.ndarray  # [N, T] int32
    targets: np.ndarray  # [N, T] int32
    loss_mask: np.ndarray  # [N, T] float32
    valid: np.ndarray  # [N, T] bool: real input tokens
    segment_ids: np.ndarray | None  # [N, T] int32 (packing="segments")

    def __len__(self):
        return len(self.tokens)


def _windows(stream: np.ndarray, live: np.ndarray, t: int):
    """Cut a stream into rows of t inputs + the next token (stride t), padding the tail."""
    n = max(1, -(-(len(stream) - 1) // t))
    need = n * t + 1
    stream = np.concatenate([stream, np.zeros(max(0, need - len(stream)), stream.dtype)])
    live = np.concatenate([live, np.zeros(max(0, need - len(live)), bool)])
    idx = np.arange(n)[:, None] * t + np.arange(t + 1)[None, :]
    return stream[idx], live[idx]


def build_rows(corpus: TokenizedCorpus, seq_len: int, packing: str, rng: np.random.Generator) -> Rows:
    t = seq_len
    order = rng.permutation(corpus.n_docs)
    docs = [corpus.doc(i) for i in order]
    pad = corpus.pad_id
    if packing == "concat":
        stream = np.concatenate(docs)
        w, live = _windows(stream, np.ones(len(stream), bool), t)
        w = np.where(live, w, pad)
        rows = Rows(w[:, :-1].astype(np.int32), w[:, 1:].astype(np.int32),
                    (live[:, :-1] & live[:, 1:]).astype(np.float32), live[:, :-1].copy(), None)
    elif packing == "pad":
        toks, lives = [], []
        for d in docs:
            w, live = _windows(d, np.ones(len(d), bool), t)
            toks.append(w)
            lives.append(live)
        w, live = np.concatenate(toks), np.concatenate(lives)
        w = np.where(live, w, pad)
        rows = Rows(w[:, :-1].astype(np.int32), w[:, 1:].astype(np.int32),
                    (live[:, :-1] & live[:, 1:]).astype(np.float32), live[:, :-1].copy(), None)
    elif packing == "segments":
        pieces = [d[s:s + t] for d in docs for s in range(0, max(len(d) - 1, 1), t)]
        pieces = [p for p in pieces if len(p) > 0]
        total = sum(len(p) for p in pieces)
        n_rows = max(1, -(-total // t))
        tok = np.full((n_rows, t), pad, np.int32)
        tgt = np.full((n_rows, t), pad, np.int32)
        mask = np.zeros((n_rows, t), np.float32)
        seg = np.full((n_rows, t), -1, np.int32)
        r, col, sid = 0, 0, 0
        for p in pieces:
            while len(p):
                room = t - col
                take = p[:room]
                k = len(take)
                tok[r, col:col + k] = take
                tgt[r, col:col + k - 1] = take[1:]
                mask[r, col:col + k - 1] = 1.0
                seg[r, col:col + k] = sid
                sid += 1
                col += k
                p = p[k:]
                if col == t:
                    r, col = r + 1, 0
        valid = seg >= 0
        # padding forms its own (never attended, never scored) segment per row
        seg = np.where(valid, seg, np.int32(2**31 - 1))
        rows = Rows(tok, tgt, mask, valid, seg)
    else:
        raise DataError(f"unknown packing {packing!r}")
    perm = rng.permutation(len(rows))
    return Rows(rows.tokens[perm], rows.targets[perm], rows.loss_mask[perm], rows.valid[perm],
                None if rows.segment_ids is None else rows.segment_ids[perm])


class Dataset:
    """Batches at positions ``{"epoch": e, "row": r}`` over a tokenized corpus (see the module docstring)."""

    def __init__(self, corpus: TokenizedCorpus, *, seq_len: int, batch_size: int, packing: str = "concat",
                 seed: int = 0, hasher=None):
        self.corpus = corpus
        self.seq_len, self.batch_size, self.packing, self.seed = seq_len, batch_size, packing, seed
        self.hasher = hasher
        self._epoch_cache: tuple[int, Rows] | None = None
        self._lock = threading.Lock()

    def fingerprint(self) -> str:
        return f"{self.corpus.fingerprint()}-T{self.seq_len}-{self.packing}-s{self.seed}"

    def rows(self, epoch: int) -> Rows:
        with self._lock:
            if self._epoch_cache is None or self._epoch_cache[0] != epoch:
                rng = np.random.default_rng([self.seed, epoch])
                self._epoch_cache = (epoch, build_rows(self.corpus, self.seq_len, self.packing, rng))
            return self._epoch_cache[1]

    @property
    def rows_per_epoch(self) -> int:
        return len(self.rows(0))

    def batch_at(self, position: dict) -> tuple[dict, dict]:
        """(batch, position of the next batch)."""
        epoch, row = int(position["epoch"]), int(position["row"])
        parts: list[Rows] = []
        need = self.batch_size
        while need:
            rows = self.rows(epoch)
            if row >= len(rows):
                epoch, row = epoch + 1, 0
                continue
            k = min(need, len(rows) - row)
            sl = slice(row, row + k)
            parts.append(Rows(rows.tokens[sl], rows.targets[sl], rows.loss_mask[sl], rows.valid[sl],
                              None if rows.segment_ids is None else rows.segment_ids[sl]))
            row += k
            need -= k
        cat = lambda name: np.concatenate([getattr(p, name) for p in parts])  # noqa: E731
        batch = {"tokens": cat("tokens"), "targets": cat("targets"), "loss_mask": cat("loss_mask"),
                 "valid": cat("valid")}
        if parts[0].segment_ids is not None:
            batch["segment_ids"] = cat("segment_ids")
        if self.hasher is not None:
            batch["engram_ids"] = self.hasher.row_ids(batch["tokens"], valid=batch["valid"],
                                                      segment_ids=batch.get("segment_ids"))
        if row >= len(self.rows(epoch)):
            epoch, row = epoch + 1, 0
        return batch, {"epoch": epoch, "row": row}


class DataLoader:
    """Iterates batches from a position, preparing the next ones on a background thread. ``position`` is the
    position of the next batch the caller will receive (what a checkpoint stores)."""

    def __init__(self, dataset: Dataset, position: dict | None = None, *, prefetch: int = 2):
        self.dataset = dataset
        self.position = dict(position or {"epoch": 0, "row": 0})
        self._prefetch = prefetch
        self._queue: queue.Queue | None = None
        self._thread = None
        self._stop = threading.Event()

    def _worker(self, start: dict):
        pos = dict(start)
        while not self._stop.is_set():
            try:
                item = self.dataset.batch_at(pos)
            except BaseException as e:  # surfaced to the consumer
                self._queue.put(e)
                return
            pos = item[1]
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        if self._prefetch <= 0:
            batch, self.position = self.dataset.batch_at(self.position)
            return batch
        if self._thread is None:
            self._queue = queue.Queue(maxsize=self._prefetch)
            self._thread = threading.Thread(target=self._worker, args=(dict(self.position),), daemon=True)
            self._thread.start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        batch, self.position = item
        return batch

    def close(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._thread = None


def load_corpus(paths: Sequence[str], tokenizer, *, glob: str = "*", text_key: str = "text",
                model_vocab_size: int | None = None, max_docs: int | None = None, exclude: str = "",
                report: ReadReport | None = None) -> TokenizedCorpus:
    docs = read_documents(paths, glob=glob, text_key=text_key, max_docs=max_docs, exclude=exclude, report=report)
    return tokenize_documents(docs, tokenizer, model_vocab_size=model_vocab_size)
