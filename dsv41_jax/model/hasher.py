"""``EngramHasher``: host-side Engram addressing (row ids) for one config and tokenizer.

Kept apart from the NNX owner (``model/model.py``) so that serving (``Engine``) does not import Flax.
"""

from __future__ import annotations

import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.ops.engram_hash import (EngramHashLayout, EngramHistory, device_engram_hash, engram_row_ids,
                                       engram_row_ids_step)
from dsv41_jax.tokenizer import ByteTokenizer, compressed_token_map


class EngramHasher:
    """Engram row ids for a config + tokenizer: the compressed vocabulary (its size is checked against the config),
    the prime / multiplier layout, and whole-sequence or incremental hashing (numpy int64, exact)."""

    def __init__(self, config: ModelConfig, token_map: np.ndarray):
        self.config = config
        self.token_map = np.asarray(token_map, np.int64)
        self._device_tables = None  # built on first use by device_tables()
        if len(self.token_map) < config.vocab_size:
            raise ValueError(f"Engram token map covers {len(self.token_map)} ids but vocab_size is "
                             f"{config.vocab_size}")
        pad = int(self.token_map[config.engram_pad_id])
        self.layout = EngramHashLayout.build(config.engram_layer_ids, config.engram_max_ngram_size,
                                             config.engram_n_heads, config.engram_vocab_size,
                                             config.engram_compressed_vocab_size, pad)
        for slot, (rows, need) in enumerate(zip(config.engram_num_embeddings, self.layout.rows_per_layer)):
            if rows < need:
                raise ValueError(f"config field `engram_num_embeddings`[{slot}] = {rows} is smaller than the "
                                 f"{need} rows its primes address")

    @classmethod
    def from_tokenizer(cls, config: ModelConfig, tokenizer) -> "EngramHasher":
        token_map, _ = compressed_token_map(tokenizer, expected_size=config.engram_compressed_vocab_size)
        return cls(config, token_map)

    def row_ids(self, tokens, *, valid=None, segment_ids=None) -> np.ndarray:
        return engram_row_ids(np.asarray(tokens), self.token_map, self.layout, valid=valid, segment_ids=segment_ids)

    def empty_history(self, batch: int) -> EngramHistory:
        return EngramHistory.empty(batch, self.config.engram_max_ngram_size)

    def step(self, tokens, history: EngramHistory, *, valid=None):
        return engram_row_ids_step(np.asarray(tokens), history, self.token_map, self.layout, valid=valid)

    def device_tables(self):
        """The hash constants on the device (``ops.engram_hash.DeviceEngramHash``, built once) for the decode
        step's own hashing (``inference.decode.decode_chain``)."""
        if self._device_tables is None:
            self._device_tables = device_engram_hash(self.token_map, self.layout)
        return self._device_tables


def default_hasher(config: ModelConfig, tokenizer=None) -> EngramHasher | None:
    """The hasher for a tokenizer (byte-level by default), or None for configs without Engram."""
    if not config.engram_layer_ids:
        return None
    return EngramHasher.from_tokenizer(config, tokenizer or ByteTokenizer(model_vocab_size=config.vocab_size))


__all__ = ["EngramHasher", "default_hasher"]
