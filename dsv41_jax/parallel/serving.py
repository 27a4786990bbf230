"""The inference engine's programs under a mesh, with explicit in/out shardings (caches keep their sharding
from step to step, the donated cache is updated in place).

* :func:`sharded_decode_step` — one token per slot through all layers (``dsv41_jax.inference.decode``).
* :func:`sharded_ced_prefill` — the two CED prefill programs (``dsv41_jax.inference.prefill``): the encoder over one
  prompt chunk (+ the decoder source's compressed KV), and the decoder replay of the last ``replay_len`` tokens.

They wrap the engine's pure step functions with :func:`dsv41_jax.parallel.sharded_jit`. The engine's own host
loops (``prefill``, ``decode_step``, ``Engine``) also run sharded as they are: call them inside
``sharding_context(mesh, rules)`` with parameters from ``shard_params`` and a cache placed with
``cache_shardings`` — XLA propagates the shardings through their jitted functions (tests/test_sharding.py).
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from dsv41_jax.parallel.api import batch_sharding, cache_shardings, param_shardings, sharded_jit
from dsv41_jax.parallel.rules import check_batch, check_model, get_rules, logical_to_spec


def _engine(name):
    return importlib.import_module(f"dsv41_jax.inference.{name}")


def _unwrap(fn):
    return getattr(fn, "__wrapped__", fn)


def _shardings(config, mesh, rules, cache):
    rules = get_rules(rules)
    check_model(config, mesh, rules)
    b = int(cache["length"].shape[0])
    check_batch(b, mesh, rules)
    return rules, b, param_shardings(config, mesh, rules), cache_shardings(cache, mesh, rules)


def sharded_decode_step(config, mesh, rules, opts, cache):
    """``step(params, cache, tokens [B], engram_ids [B, L, n] | None, active [B]) -> (logits [B, V], cache)``.

    ``cache`` (arrays or ShapeDtypeStructs) fixes the batch and cache shapes; the returned cache has the input's
    shardings and the input cache is donated."""
    dec = _engine("decode")
    rules, b, p_sh, c_sh = _shardings(config, mesh, rules, cache)
    n_eng = len(config.engram_layer_ids)
    vec = batch_sharding(mesh, rules, (b,))
    eng = batch_sharding(mesh, rules, (b, n_eng, config.n_hash_cols)) if n_eng else None
    logits = NamedSharding(mesh, logical_to_spec(("batch", "vocab"), mesh, rules))
    step = _unwrap(dec._step)

    def fn(params, cache, tokens, engram_ids, active):
        return step(params, cache, tokens, engram_ids, active, config, opts)[:2]  # (a full slot's logits: NaN)

    return sharded_jit(fn, mesh, rules, in_shardings=(p_sh, c_sh, vec, eng, vec), out_shardings=(logits, c_sh),
                       params_argnum=0, config=config, donate_argnums=(1,))


def sharded_ced_prefill(config, mesh, rules, opts, cache, chunk: int):
    """The two CED prefill programs under ``mesh``:

    ``encoder(params, cache, stash, tokens [B, chunk], n_valid [B], engram_ids) -> (cache, stash)`` and
    ``decoder(params, cache, stash, n_new [B], engram_ids [B, replay, ...]) -> (last_logits [B, V], cache)``,
    plus the abstract ``stash`` (the encoder output ring the decoder replays)."""
    pre = _engine("prefill")
    rules, b, p_sh, c_sh = _shardings(config, mesh, rules, cache)
    r = opts.resolved_replay(config)
    dtype = jax.tree.leaves(cache["swa"])[0].dtype
    stash = {"streams": jax.ShapeDtypeStruct((b, r, config.hc_mult, config.hidden_size), dtype),
             "pre_mix": jax.ShapeDtypeStruct((b, r, config.hc_mult), jnp.float32)}
    s_sh = cache_shardings(stash, mesh, rules)
    n_eng = len(config.engram_layer_ids)
    vec = batch_sharding(mesh, rules, (b,))
    tok = batch_sharding(mesh, rules, (b, chunk))

    def eng(t):
        return batch_sharding(mesh, rules, (b, t, n_eng, config.n_hash_cols)) if n_eng else None

    logits = NamedSharding(mesh, logical_to_spec(("batch", "vocab"), mesh, rules))
    ced_chunk, ced_decoder = _unwrap(pre._ced_chunk), _unwrap(pre._ced_decoder)

    def encoder(params, cache, stash, tokens, n_valid, engram_ids):
        return ced_chunk(params, cache, stash, tokens, n_valid, engram_ids, config=config, opts=opts)

    def decoder(params, cache, stash, n_new, engram_ids):
        last, _, cache = ced_decoder(params, cache, stash, n_new, engram_ids, config=config, opts=opts,
                                     all_logits=False)
        return last, cache

    enc = sharded_jit(encoder, mesh, rules, in_shardings=(p_sh, c_sh, s_sh, tok, vec, eng(chunk)),
                      out_shardings=(c_sh, s_sh), params_argnum=0, config=config, donate_argnums=(1, 2))
    dec = sharded_jit(decoder, mesh, rules, in_shardings=(p_sh, c_sh, s_sh, vec, eng(r)),
                      out_shardings=(logits, c_sh), params_argnum=0, config=config, donate_argnums=(1,))
    stash = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), stash, s_sh)
    return enc, dec, stash
