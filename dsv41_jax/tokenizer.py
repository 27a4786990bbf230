"""Tokenizers for dsv41_jax, and the Engram compressed-vocabulary map.

Two implementations behind one small interface (``encode`` / ``decode`` /
``vocab_size`` / ``bos_id`` / ``eos_id`` / ``pad_id``):

* ``HFTokenizer`` wraps a HuggingFace ``tokenizer.json`` (the released model's
  tokenizer) through the ``tokenizers`` library.
* ``ByteTokenizer`` is a dependency-free byte-level fallback for tests and tiny
  models without a trained tokenizer.

``compressed_token_map`` builds the tokenizer-normalised canonical map that the
Engram hash runs on (SPEC §7): tokens whose text normalises to the same string
(" The", "the", "THE") share one compressed id.  Every hash multiplier depends on
the number of compressed ids, so this must reproduce the reference exactly.
"""

from __future__ import annotations

import os
from typing import Callable, Optional, Protocol, Sequence, Union

import numpy as np

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "load_tokenizer",
    "compressed_token_map",
    "canonical_normalizer",
]

# Released DeepSeek special ids (SPEC §1: bos 0, eos 1, pad 2), also the
# ByteTokenizer's layout, and the fallback when a tokenizer.json has no config.
DEFAULT_BOS_ID, DEFAULT_EOS_ID, DEFAULT_PAD_ID = 0, 1, 2


class Tokenizer(Protocol):
    """What the rest of dsv41_jax relies on."""

    @property
    def vocab_size(self) -> int: ...  # number of token ids, added/special tokens included

    @property
    def bos_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


def _check_model_vocab(vocab_size: int, model_vocab_size: Optional[int], what: str) -> None:
    if model_vocab_size is not None and vocab_size > model_vocab_size:
        raise ValueError(
            f"{what} has {vocab_size} token ids but the model's embedding only has "
            f"{model_vocab_size} rows; ids >= {model_vocab_size} would be out of range"
        )


# --------------------------------------------------------------------------------------
# Byte-level fallback
# --------------------------------------------------------------------------------------


class ByteTokenizer:
    """Byte-level tokenizer: UTF-8 bytes shifted past three special tokens.

    Id mapping (vocab size 259):
      0 = bos (``<|bos|>``), 1 = eos (``<|eos|>``), 2 = pad (``<|pad|>``) — the same
      special ids as the released model — and ``3 + b`` for byte ``b`` in 0..255.

    Any text round-trips exactly; decoding invalid UTF-8 (e.g. a truncated
    generation) replaces the broken bytes with U+FFFD.
    """

    SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
    BYTE_OFFSET = len(SPECIAL_TOKENS)

    def __init__(self, model_vocab_size: Optional[int] = None):
        _check_model_vocab(self.vocab_size, model_vocab_size, "ByteTokenizer")

    @property
    def vocab_size(self) -> int:
        return self.BYTE_OFFSET + 256

    bos_id = property(lambda self: DEFAULT_BOS_ID)
    eos_id = property(lambda self: DEFAULT_EOS_ID)
    pad_id = property(lambda self: DEFAULT_PAD_ID)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = [b + self.BYTE_OFFSET for b in text.encode("utf-8")]
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        out = bytearray()
        parts: list[str] = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} outside [0, {self.vocab_size})")
            if i >= self.BYTE_OFFSET:
                out.append(i - self.BYTE_OFFSET)
            elif not skip_special_tokens:
                # Flush pending bytes first so specials land in order.
                parts.append(out.decode("utf-8", errors="replace"))
                out.clear()
                parts.append(self.SPECIAL_TOKENS[i])
        parts.append(out.decode("utf-8", errors="replace"))
        return "".join(parts)

    def id_to_token(self, i: int) -> str:
        """Raw token string: the special's name, or ``<0xNN>`` for a byte."""
        if i < self.BYTE_OFFSET:
            return self.SPECIAL_TOKENS[i]
        return f"<0x{i - self.BYTE_OFFSET:02X}>"


# --------------------------------------------------------------------------------------
# HuggingFace tokenizer.json
# --------------------------------------------------------------------------------------


def _special_from_config(config: dict, key: str) -> Optional[str]:
    value = config.get(key)
    if isinstance(value, dict):  # {"content": "...", ...} form of tokenizer_config.json
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from ``tokenizer.json``.

    ``path`` is the file or a directory holding it.  bos/eos/pad ids come from the
    explicit arguments, else from ``tokenizer_config.json`` beside the file
    (``bos_token`` / ``eos_token`` / ``pad_token``), else from the released
    model's 0/1/2.
    """

    def __init__(
        self,
        path: Union[str, os.PathLike],
        *,
        model_vocab_size: Optional[int] = None,
        bos_id: Optional[int] = None,
        eos_id: Optional[int] = None,
        pad_id: Optional[int] = None,
    ):
        from tokenizers import Tokenizer as _RustTokenizer

        path = os.fspath(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        self.path = file
        if not os.path.isfile(file):
            raise FileNotFoundError(f"tokenizer not found: {file} (pass a tokenizer.json or a directory holding one)")
        from dsv41_jax.jsonfile import read_json_object

        read_json_object(file, "an HF tokenizer.json (a JSON object)")  # names the file for empty / bad JSON
        try:
            self.backend = _RustTokenizer.from_file(file)
        except Exception as e:  # noqa: BLE001 - the Rust error is a bare Exception
            raise ValueError(f"cannot read tokenizer {file}: {e}") from e
        # Same count as transformers' len(tokenizer): base vocab plus added tokens.
        self._vocab_size = int(self.backend.get_vocab_size(with_added_tokens=True))
        _check_model_vocab(self._vocab_size, model_vocab_size, f"tokenizer {file}")

        config: dict = {}
        config_file = os.path.join(os.path.dirname(file), "tokenizer_config.json")
        if os.path.exists(config_file):
            config = read_json_object(config_file, "a JSON object (tokenizer_config.json)")

        def resolve(explicit: Optional[int], key: str, default: int) -> int:
            if explicit is not None:
                return int(explicit)
            name = _special_from_config(config, key)
            if name is not None:
                tid = self.backend.token_to_id(name)
                if tid is None:
                    raise ValueError(f"{config_file}: {key} {name!r} is not in {file}")
                return int(tid)
            return default

        self._bos = resolve(bos_id, "bos_token", DEFAULT_BOS_ID)
        self._eos = resolve(eos_id, "eos_token", DEFAULT_EOS_ID)
        self._pad = resolve(pad_id, "pad_token", DEFAULT_PAD_ID)
        for name, tid in (("bos", self._bos), ("eos", self._eos), ("pad", self._pad)):
            if not 0 <= tid < self._vocab_size:
                raise ValueError(f"{name} id {tid} outside the tokenizer's [0, {self._vocab_size})")

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    bos_id = property(lambda self: self._bos)
    eos_id = property(lambda self: self._eos)
    pad_id = property(lambda self: self._pad)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        # Specials are added here explicitly, not by the tokenizer's post-processor,
        # so both implementations behave alike.
        ids = list(self.backend.encode(text, add_special_tokens=False).ids)
        return ([self._bos] if add_bos else []) + ids + ([self._eos] if add_eos else [])

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> Optional[str]:
        return self.backend.id_to_token(int(i))


def load_tokenizer(
    path: Union[str, os.PathLike, None], *, model_vocab_size: Optional[int] = None
) -> Union[ByteTokenizer, HFTokenizer]:
    """``HFTokenizer`` for a tokenizer.json (or a directory holding one), else ``ByteTokenizer``."""
    if path is None:
        return ByteTokenizer(model_vocab_size=model_vocab_size)
    return HFTokenizer(path, model_vocab_size=model_vocab_size)


# --------------------------------------------------------------------------------------
# Engram canonical (compressed) token map
# --------------------------------------------------------------------------------------

# A private-use code point standing in for "this token is exactly one space" while
# Strip runs, so a lone-space token keeps a non-empty key of its own.
_SPACE_SENTINEL = "\ue000"
_REPLACEMENT_CHAR = "\ufffd"


def canonical_normalizer():
    """The Engram key normaliser (a ``tokenizers`` normalizer), as in the reference:

    NFKC, NFD, strip accents, lowercase, collapse runs of space/tab/CR/LF to one
    space, protect a lone space with a sentinel, strip surrounding whitespace,
    restore the sentinel to a space.
    """
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SPACE_SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SPACE_SENTINEL, " "),
        ]
    )


def _intern_keys(texts: Sequence[str], raw_token: Callable[[int], object]) -> tuple[np.ndarray, int]:
    """First-seen interning of each id's canonical key, in id order."""
    normalizer = canonical_normalizer()
    key_to_new: dict = {}
    lookup = np.empty((len(texts),), dtype=np.int64)
    for tid, text in enumerate(texts):
        if _REPLACEMENT_CHAR in text:
            # Decoding a lone partial UTF-8 byte token yields U+FFFD; normalising
            # that would merge all such tokens, so key them by their raw form.
            key = raw_token(tid)
        else:
            # A token that normalises to "" (e.g. other whitespace) keeps its text.
            key = normalizer.normalize_str(text) or text
        lookup[tid] = key_to_new.setdefault(key, len(key_to_new))
    return lookup, len(key_to_new)


def compressed_token_map(tokenizer, *, expected_size: Optional[int] = None) -> tuple[np.ndarray, int]:
    """``(token_map int64 [vocab_size], compressed_vocab_size)`` for Engram hashing.

    For every id in ``range(vocab_size)`` (special and added tokens included), the
    key is the id's decoded text (specials not skipped) under
    ``canonical_normalizer`` — or, if normalising gives "", the text itself; ids
    whose decoded text contains U+FFFD (partial UTF-8 byte tokens) are keyed by
    their raw token string instead.  Distinct keys get compressed ids 0, 1, 2, ...
    in order of first appearance by id.  This is the reference's
    ``build_compressed_token_map`` applied to the raw Rust tokenizer.

    Accepts ``HFTokenizer``, a bare ``tokenizers.Tokenizer``, or ``ByteTokenizer``.
    For the ByteTokenizer the same rule is applied to its natural per-id text:
    specials decode to their names (``<|bos|>``...), bytes < 0x80 to their ASCII
    character, bytes >= 0x80 (never valid UTF-8 alone) to U+FFFD and are thus
    keyed raw as ``<0xNN>``.  Net effect: upper/lower-case ASCII letters merge and
    tab/LF/CR/space merge into " "; everything else stays distinct.

    ``expected_size`` (the config's ``engram_compressed_vocab_size``; 99092 for the
    released model): raise ValueError if the map has a different size — the hash
    multipliers derive from it, so a mismatch would silently rehash every table.
    """
    token_map, size = _compressed_token_map(tokenizer)
    if expected_size is not None and size != expected_size:
        raise ValueError(
            f"the tokenizer yields {size} compressed ids but engram_compressed_vocab_size is "
            f"{expected_size}; Engram rows would be hashed differently from the checkpoint's"
        )
    return token_map, size


def _compressed_token_map(tokenizer) -> tuple[np.ndarray, int]:
    if isinstance(tokenizer, ByteTokenizer):
        n = tokenizer.vocab_size
        texts = [tokenizer.decode([i], skip_special_tokens=False) for i in range(n)]
        return _intern_keys(texts, tokenizer.id_to_token)

    backend = getattr(tokenizer, "backend", tokenizer)  # HFTokenizer or tokenizers.Tokenizer
    if not hasattr(backend, "decode_batch") or not hasattr(backend, "id_to_token"):
        raise TypeError(f"compressed_token_map: unsupported tokenizer type {type(tokenizer).__name__}")
    n = int(backend.get_vocab_size(with_added_tokens=True))
    # Decode each id on its own (batched only for speed; same result as one
    # decode([id]) call per id), without skipping specials and without any
    # transformers-side clean-up.
    texts = backend.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    return _intern_keys(texts, backend.id_to_token)
