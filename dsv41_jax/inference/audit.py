"""Structural audit of the jitted decode step: what in its program can stall a GPU between kernels.

A decode step should run as one device program with no host round-trip inside it. On a GPU, XLA evaluates the
predicate of a ``while`` loop whose trip count it cannot prove on the device and copies it to the host before every
iteration (one device->host copy and a host wait per iteration); a ``cond`` copies its branch index the same way;
host callbacks stop the stream. Loops with a static trip count (``lax.scan``, ``fori_loop`` with Python-int bounds)
do not. Concatenates or copies of cache-sized buffers cost a cache-sized HBM round trip per layer.

:func:`audit_decode_step` traces the decode program (``decode_and_sample``, or ``decode_chain``: the step
``Engine.generate`` runs, which also hashes the Engram n-grams and feeds its tokens on the device) on abstract shapes
(nothing is allocated, so full-width configs work on a laptop) and walks its jaxpr — every nested jaxpr except the
bodies of Pallas kernels, whose loops run inside one kernel — counting those constructs. ``benchmarks/
decode_graph_report.py`` prints the counts; tests pin the structural properties so they cannot regress.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
from jax.extend import core as jex_core
import jax.numpy as jnp
import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.inference.cache import abstract_cache
from dsv41_jax.inference.step import InferenceOptions
from dsv41_jax.model.params import abstract_params

HOST_SYNC = ("while", "cond")  # control flow whose next move the host decides (on GPU: a D2H copy each time)
CALLBACKS = ("pure_callback", "io_callback", "debug_callback", "callback")
KERNELS = ("pallas_call", "custom_call")  # opaque to the walk: their inner loops run inside one kernel


@dataclasses.dataclass
class GraphAudit:
    """Counts over a decode program's jaxpr (nested jaxprs included, Pallas kernel bodies excluded)."""

    primitives: collections.Counter  # primitive name -> occurrences
    dynamic_loops: list  # one description per `while` (dynamic trip count: a host round-trip per iteration on GPU)
    conds: int  # `cond` / `switch` (a host round-trip per execution on GPU)
    callbacks: int
    scans: list  # (static trip count, unrolled) of `scan` loops (fori_loop with Python-int bounds included)
    big_concats: list  # (shape, bytes) of concatenates at least `big_bytes` in size
    big_copies: list  # (primitive, shape, bytes) of explicit copies at least `big_bytes` in size
    kernels: int  # Pallas kernel launches traced (each runs its loops on the device)
    big_bytes: int

    @property
    def equations(self) -> int:
        return sum(self.primitives.values())

    def summary(self) -> dict:
        return dict(equations=self.equations, dynamic_while=len(self.dynamic_loops), cond=self.conds,
                    callbacks=self.callbacks, rolled_scans=sum(1 for _, u in self.scans if not u),
                    rolled_scan_iterations=sum(n for n, u in self.scans if not u),
                    unrolled_scans=sum(1 for _, u in self.scans if u),
                    big_concatenates=len(self.big_concats), big_copies=len(self.big_copies), kernels=self.kernels)


def _sub_jaxprs(eqn):
    for v in eqn.params.values():
        items = v if isinstance(v, (tuple, list)) else (v,)
        for it in items:
            if isinstance(it, jex_core.ClosedJaxpr):
                yield it.jaxpr
            elif isinstance(it, jex_core.Jaxpr):
                yield it


def _nbytes(aval) -> int:
    shape = getattr(aval, "shape", ())
    return int(np.prod(shape, dtype=np.int64)) * jnp.dtype(aval.dtype).itemsize if hasattr(aval, "dtype") else 0


def audit_jaxpr(jaxpr, big_bytes: int) -> GraphAudit:
    a = GraphAudit(collections.Counter(), [], 0, 0, [], [], [], 0, big_bytes)

    def walk(jx, multiplier: int):
        for eqn in jx.eqns:
            name = eqn.primitive.name
            a.primitives[name] += multiplier
            if name == "while":
                body = eqn.params["body_jaxpr"].jaxpr
                a.dynamic_loops.append(f"while: {len(body.eqns)} body equations, carry "
                                       f"{[tuple(v.aval.shape) for v in body.invars][:4]}...")
            elif name == "cond":
                a.conds += multiplier
            elif name in CALLBACKS:
                a.callbacks += multiplier
            elif name == "scan":
                a.scans.append((int(eqn.params["length"]), int(eqn.params.get("unroll", 1)) >= eqn.params["length"]))
            elif name == "concatenate":
                nb = _nbytes(eqn.outvars[0].aval)
                if nb >= big_bytes:
                    a.big_concats.append((tuple(eqn.outvars[0].aval.shape), nb))
            elif name in ("copy", "copy_p", "device_put"):
                for v in eqn.outvars:
                    nb = _nbytes(v.aval)
                    if nb >= big_bytes:
                        a.big_copies.append((name, tuple(v.aval.shape), nb))
            if name in KERNELS:
                a.kernels += multiplier
                continue
            inner = multiplier * (int(eqn.params["length"]) if name == "scan" else 1)
            for sub in _sub_jaxprs(eqn):
                walk(sub, inner)

    walk(jaxpr, 1)
    return a


def decode_program(config: ModelConfig, batch: int, max_len: int, *, dtype=jnp.bfloat16,
                   opts: InferenceOptions = InferenceOptions(), chained: bool = False, readback: int = 8,
                   hasher=None, sampler: str = "filtered", packed: bool = False):
    """(function, abstract arguments) of a decode step, ready for ``jax.make_jaxpr`` / ``jax.jit(...).lower``:
    ``decode_and_sample`` (decode + sampling, the Engram rows given), or with ``chained`` the step ``Engine.generate``
    runs, ``decode_chain`` (the Engram hash on the device, its tokens fed to the next step, a ``readback`` ring;
    its tables' shapes from ``hasher``, default ``model.hasher.default_hasher(config)``); ``sampler`` as
    ``decode_chain``'s (``sampling.sampler_for``); ``packed``: the release's packed cache (``init_cache(packed=True)``)."""
    from dsv41_jax.inference.decode import _decode_chain, _decode_opts, _decode_sample

    opts = _decode_opts(opts)
    params = abstract_params(config, dtype)
    cache = abstract_cache(config, batch, max_len, dtype, packed=packed)
    vec = lambda dt: jax.ShapeDtypeStruct((batch,), dt)  # noqa: E731
    if chained:
        state = {"tokens": vec(jnp.int32), "active": vec(jnp.bool_), "generated": vec(jnp.int32),
                 "step": jax.ShapeDtypeStruct((), jnp.int32),
                 "readback": jax.ShapeDtypeStruct((readback + 1, batch), jnp.int32)}
        tables = None
        if config.engram_layer_ids:
            if hasher is None:
                from dsv41_jax.model.hasher import default_hasher

                hasher = default_hasher(config)
            tables = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), hasher.device_tables())
            state["engram_history"] = jax.ShapeDtypeStruct((batch, config.engram_max_ngram_size - 1), jnp.int32)
        args = (params, cache, state, tables, vec(jnp.float32), vec(jnp.int32), vec(jnp.float32), vec(jnp.int32),
                jax.ShapeDtypeStruct((batch, 1), jnp.int32), vec(jnp.int32), vec(jnp.int32))

        def chain(params, cache, state, tables, temperature, top_k, top_p, seeds, stops, max_new, room):
            return _decode_chain(params, cache, state, tables, temperature, top_k, top_p, seeds, stops, max_new,
                                 room, config=config, opts=opts, sampler=sampler)

        return chain, args
    eids = None
    if config.engram_layer_ids:
        eids = jax.ShapeDtypeStruct((batch, len(config.engram_layer_ids), config.n_hash_cols), jnp.int32)
    args = (params, cache, vec(jnp.int32), eids, vec(jnp.bool_), vec(jnp.float32), vec(jnp.int32), vec(jnp.float32),
            vec(jnp.int32), vec(jnp.int32))

    def fn(params, cache, tokens, engram_ids, active, temperature, top_k, top_p, seeds, steps):
        return _decode_sample(params, cache, tokens, engram_ids, active, temperature, top_k, top_p, seeds, steps,
                              config=config, opts=opts, return_logits=False)

    return fn, args


def smallest_source_bytes(config: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> int:
    """Bytes of the smallest compressed-KV cache leaf: the 'cache-sized' threshold of the audit."""
    cache = abstract_cache(config, batch, max_len, dtype)
    sizes = [_nbytes(x) for src in cache["sources"].values() for x in (src["kv"], src["keys"])]
    return min(sizes) if sizes else _nbytes(cache["swa"][0])


def audit_decode_step(config: ModelConfig, batch: int, max_len: int, *, dtype=jnp.bfloat16,
                      opts: InferenceOptions = InferenceOptions(), big_bytes: int | None = None,
                      chained: bool = False) -> GraphAudit:
    """Audit the decode program of ``config`` at ``batch`` x ``max_len`` (abstract shapes; nothing allocated);
    ``chained``: ``decode_chain``, the step ``Engine.generate`` runs (see :func:`decode_program`)."""
    fn, args = decode_program(config, batch, max_len, dtype=dtype, opts=opts, chained=chained)
    jaxpr = jax.make_jaxpr(fn)(*args)
    if big_bytes is None:
        big_bytes = smallest_source_bytes(config, batch, max_len, dtype)
    return audit_jaxpr(jaxpr.jaxpr, big_bytes)


def hlo_counts(config: ModelConfig, batch: int, max_len: int, *, dtype=jnp.bfloat16,
               opts: InferenceOptions = InferenceOptions()) -> dict:
    """Counts of HLO instructions in the program XLA compiles for the local backend (donated cache): loops with and
    without a known trip count, copies, dynamic-update-slices, concatenates, custom calls, fusions, and how many
    cache buffers alias an output (updated in place)."""
    fn, args = decode_program(config, batch, max_len, dtype=dtype, opts=opts)
    compiled = jax.jit(fn, donate_argnums=(1,)).lower(*args).compile()
    return hlo_text_counts(compiled.as_text(), smallest_source_bytes(config, batch, max_len, dtype),
                           len(jax.tree.leaves(args[1])))


_HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
              "s64": 8, "u64": 8, "f64": 8}


def hlo_text_counts(text: str, big_bytes: int, cache_leaves: int) -> dict:
    """Instruction counts of an HLO module's text (see :func:`hlo_counts`); ``big_*`` count results of at least
    ``big_bytes`` (a cache-sized buffer)."""
    import re

    inst = re.compile(r"=\s*(\w+)\[([\d,]*)\][^ ]*\s+([\w-]+)\(")
    counts = collections.Counter()
    big = collections.Counter()
    for line in text.splitlines():
        if re.search(r"\)\s+while\(", line) or re.search(r"\)\s+conditional\(", line):  # tuple-shaped results
            op = "while" if " while(" in line else "conditional"
            counts[op] += 1
            counts["while_known_trip"] += op == "while" and "known_trip_count" in line
            continue
        m = inst.search(line)
        if not m:
            continue
        dtype, dims, op = m.groups()
        counts[op] += 1
        n = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) * _HLO_BYTES.get(dtype, 4)
        if n >= big_bytes:
            big[op] += 1
        if op == "while" and "known_trip_count" in line:
            counts["while_known_trip"] += 1
    aliased = text.count("may-alias") + text.count("must-alias")
    return dict(while_loops=counts["while"], while_known_trip=counts["while_known_trip"],
                conditionals=counts["conditional"], copies=counts["copy"], big_copies=big["copy"],
                dynamic_update_slices=counts["dynamic-update-slice"], scatters=counts["scatter"],
                concatenates=counts["concatenate"], big_concatenates=big["concatenate"],
                custom_calls=counts["custom-call"], fusions=counts["fusion"], aliased_outputs=aliased,
                cache_leaves=cache_leaves)


__all__ = ["GraphAudit", "audit_jaxpr", "audit_decode_step", "decode_program", "hlo_counts", "hlo_text_counts",
           "smallest_source_bytes"]
