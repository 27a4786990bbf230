"""Inference: explicit cache pytrees, CED prefill with bounded replay, jitted decode, sampling, the ``Engine``.

* ``cache``    — :func:`init_cache`, byte accounting (:func:`cache_footprint`)
* ``step``     — the cached forward over a chunk of new tokens (shared by prefill and decode)
* ``prefill``  — CED / full-replay prefill, chunked, per-sequence lengths
* ``decode``   — one jitted decode step with the cache donated (optionally fused with sampling)
* ``sampling`` — greedy / temperature / top-k / top-p with explicit per-request seeds
* ``engine``   — :class:`Engine`: batched generation, streaming, per-request errors
* ``batching`` — :class:`ContinuousBatcher` / ``Engine.serve``: continuous batching of a request queue
* ``recompute``— the slow full-recompute generator, kept as an oracle
* ``audit``    — what in the decode program could stall a GPU (data-dependent loops, conditionals, callbacks,
                 cache-sized copies), for tests and ``benchmarks/decode_graph_report.py``
"""

from dsv41_jax.inference.cache import cache_bytes, cache_bytes_per_token, cache_footprint, init_cache
from dsv41_jax.inference.decode import decode_and_sample, decode_step
from dsv41_jax.inference.engine import Engine, EngineError, GenerationStats, Request, Result
from dsv41_jax.inference.batching import Completion, ContinuousBatcher
from dsv41_jax.inference.prefill import prefill, reset_slots
from dsv41_jax.inference.sampling import SamplingParams, sample
from dsv41_jax.inference.step import FAST_COMPILE, InferenceOptions

__all__ = ["Engine", "EngineError", "Request", "Result", "GenerationStats", "ContinuousBatcher", "Completion", "InferenceOptions", "FAST_COMPILE",
           "init_cache", "cache_footprint", "cache_bytes", "cache_bytes_per_token", "prefill", "reset_slots",
           "decode_step", "decode_and_sample", "SamplingParams", "sample"]
