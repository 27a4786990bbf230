"""Sharded entry points: parameter placement, cache / input shardings and ``jit`` under a mesh.

The pieces compose for any pure entry point (forward, CED prefill, decode step, train step)::

    mesh = make_mesh("data=2,expert=2,tensor=2")
    params = shard_params(params, config, mesh, "tp")            # padded Engram tables, NamedShardings
    fwd = sharded_forward(config, mesh, "tp")                     # jit with in/out shardings + rules context
    logits = fwd(params, tokens, engram_ids)

    step = sharded_jit(decode_step, mesh, "tp",                   # any other entry point
                       in_shardings=(param_shardings(config, mesh, "tp"), cache_shardings(cache, mesh, "tp"), ...),
                       out_shardings=(...), params_argnum=0, config=config)

Engram tables have prime-sum row counts (384,006,168 / 384,016,682 in the release) that no mesh divides, so
:func:`shard_params` stores them padded to a multiple of the row-shard count; :func:`unpad_params` slices them back
inside ``jit`` (a no-copy slice of the padding) before the model sees them, and XLA partitions the row lookup as a
masked local gather + reduction (no table gather). Everything else must divide exactly, or
:class:`~dsv41_jax.parallel.mesh.MeshError` names the axis and the dimension.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dsv41_jax.model.params import abstract_params, flat_specs, is_spec, param_specs
from dsv41_jax.parallel.mesh import MeshError
from dsv41_jax.parallel.rules import (Rules, check_batch, check_model, get_rules, logical_to_spec, mesh_axes_for,
                                      sharding_context)

ENGRAM_TABLE = ("engram", "embed")  # the (parent, name) of Engram row tables in the parameter tree


def _is_engram_table(path: str) -> bool:
    parts = path.split("/")
    return len(parts) >= 2 and tuple(parts[-2:]) == ENGRAM_TABLE


def engram_row_multiple(mesh, rules: Rules | str) -> int:
    return math.prod(mesh.shape[a] for a in mesh_axes_for("engram_rows", mesh, get_rules(rules)))


def padded_rows(rows: int, mesh, rules: Rules | str) -> int:
    n = engram_row_multiple(mesh, rules)
    return -(-rows // n) * n


def _padded_shape(path: str, shape: tuple[int, ...], mesh, rules) -> tuple[int, ...]:
    if _is_engram_table(path):
        return (padded_rows(shape[0], mesh, rules),) + tuple(shape[1:])
    return tuple(shape)


def _tree_from_flat(config, values: dict, include_dspark: bool):
    specs = param_specs(config, include_dspark=include_dspark)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    paths = [p for p, _ in flat_specs(config, include_dspark=include_dspark)]
    assert len(paths) == len(leaves)
    return jax.tree.unflatten(treedef, [values[p] for p in paths])


def param_partition_specs(config, mesh, rules: Rules | str, *, include_dspark: bool = False):
    """PartitionSpec of every parameter (a pytree like the parameters). Raises MeshError on a non-dividing mesh."""
    rules = get_rules(rules)
    check_model(config, mesh, rules, include_dspark=include_dspark)
    out = {}
    for path, s in flat_specs(config, include_dspark=include_dspark):
        shape = _padded_shape(path, s.shape, mesh, rules)
        out[path] = logical_to_spec(s.axes, mesh, rules, shape, strict=True, what=f"parameter {path} ({s.hf_name})")
    return _tree_from_flat(config, out, include_dspark)


def param_shardings(config, mesh, rules: Rules | str, *, include_dspark: bool = False):
    specs = param_partition_specs(config, mesh, rules, include_dspark=include_dspark)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def zero_spec(spec: P, shape: Sequence[int], mesh_shape: dict, batch_axes=("data", "expert")) -> P:
    """ZeRO split of a parameter's PartitionSpec: the batch axes the parameter is replicated on (of size > 1)
    added to the first dim they divide evenly (as many of them as divide, leading axes first); ``spec`` itself if
    no dim does. The split of the optimiser moments (ZeRO-1) and, for ZeRO-3, of the masters and gradients."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    used = {a for e in entries if e is not None for a in ((e,) if isinstance(e, str) else e)}
    free = tuple(a for a in batch_axes if a not in used and mesh_shape.get(a, 1) > 1)
    for k in range(len(free), 0, -1):
        axes = free[:k]
        size = math.prod(mesh_shape[a] for a in axes)
        for d, e in enumerate(entries):
            if e is None and shape[d] % size == 0:
                entries[d] = axes if len(axes) > 1 else axes[0]
                return P(*entries)
    return P(*entries)


def zero_param_shardings(config, mesh, rules: Rules | str, *, include_dspark: bool = False):
    """NamedShardings of the (padded) parameters split ZeRO-style over the batch axes (:func:`zero_spec`)."""
    specs = param_partition_specs(config, mesh, rules, include_dspark=include_dspark)
    shapes = {p: _padded_shape(p, s.shape, mesh, rules) for p, s in flat_specs(config, include_dspark=include_dspark)}
    flat = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    paths = [p for p, _ in flat_specs(config, include_dspark=include_dspark)]
    out = {p: NamedSharding(mesh, zero_spec(s, shapes[p], dict(mesh.shape))) for p, s in zip(paths, flat)}
    return _tree_from_flat(config, out, include_dspark)


def abstract_sharded_params(config, mesh, rules: Rules | str, dtype=jnp.bfloat16, *, include_dspark: bool = False):
    """ShapeDtypeStructs with shardings (Engram tables padded): the parameter input of an AOT compile."""
    shardings = param_shardings(config, mesh, rules, include_dspark=include_dspark)
    abstract = abstract_params(config, dtype, include_dspark=include_dspark)
    paths = [p for p, _ in flat_specs(config, include_dspark=include_dspark)]
    flat_abs = jax.tree.leaves(abstract)
    flat_sh = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    out = {p: jax.ShapeDtypeStruct(_padded_shape(p, a.shape, mesh, rules), a.dtype, sharding=s)
           for p, a, s in zip(paths, flat_abs, flat_sh)}
    return _tree_from_flat(config, out, include_dspark)


def _map_with_path(fn, params):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    out = []
    for path, leaf in leaves:
        key = "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
        out.append(fn(key, leaf))
    return jax.tree.unflatten(treedef, out)


def pad_params(params, config, mesh, rules: Rules | str):
    """Pad Engram tables to a multiple of their row-shard count (extra rows are zero and never addressed)."""
    def pad(path, x):
        if not _is_engram_table(path):
            return x
        rows = padded_rows(x.shape[0], mesh, rules)
        return x if rows == x.shape[0] else jnp.pad(x, ((0, rows - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))
    return _map_with_path(pad, params)


def unpad_params(params, config):
    """Slice padded Engram tables back to the config's row counts (inside jit: no copy of the table)."""
    want = {p: s.shape for p, s in flat_specs(config, include_dspark=isinstance(params, dict) and "dspark" in params)}

    def cut(path, x):
        if _is_engram_table(path) and path in want and x.shape[0] != want[path][0]:
            return x[: want[path][0]]
        return x
    return _map_with_path(cut, params)


def shard_params(params, config, mesh, rules: Rules | str = "tp"):
    """Place a parameter tree on ``mesh``: validate the mesh against the model, pad Engram tables, device_put."""
    include_dspark = isinstance(params, dict) and "dspark" in params
    shardings = param_shardings(config, mesh, rules, include_dspark=include_dspark)
    padded = pad_params(params, config, mesh, rules)
    return jax.tree.map(_place, padded, shardings)


def _place(x, sharding: NamedSharding):
    """device_put, or — for a sharding spanning other processes' devices — this process's shards of ``x`` (every
    process holds the same full value, e.g. from the same seed or checkpoint)."""
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


# ----------------------------------------------------------------------------------------------------------------
# inputs, caches
# ----------------------------------------------------------------------------------------------------------------

def batch_sharding(mesh, rules: Rules | str, shape: Sequence[int], *, check: bool = True,
                   axes: Sequence[str | None] | None = None) -> NamedSharding:
    """Sharding of an input whose dim 0 is the batch (tokens, positions, Engram ids, per-sequence state)."""
    rules = get_rules(rules)
    if check and len(shape):
        check_batch(int(shape[0]), mesh, rules)
    axes = tuple(axes) if axes is not None else ("batch",) + (None,) * (len(shape) - 1)
    return NamedSharding(mesh, logical_to_spec(axes, mesh, rules, shape, strict=True, what="batch input"))


def cache_shardings(cache, mesh, rules: Rules | str = "tp", axes=None):
    """NamedShardings for a cache pytree.

    ``axes``: a matching pytree of logical-axis tuples, or a callable ``(path, leaf) -> tuple | None``; by default
    dim 0 of every array leaf is the batch and the rest is replicated — so SWA rings, compressed KV, indexer keys
    (the single K=V latent and the indexer key width stay replicated) and per-sequence counters split with the
    batch, consistently with the forward's activations. Scalars are replicated.
    """
    rules = get_rules(rules)

    def default(path, leaf):
        shape = getattr(leaf, "shape", ())
        return ("batch",) + (None,) * (len(shape) - 1) if len(shape) else ()

    if axes is None:
        axes_fn = default
    elif callable(axes):
        axes_fn = axes
    else:
        flat_axes = jax.tree.leaves(axes, is_leaf=lambda a: isinstance(a, tuple))
        flat_cache = jax.tree_util.tree_flatten_with_path(cache)[0]
        lookup = {id(leaf): ax for (_, leaf), ax in zip(flat_cache, flat_axes)}
        axes_fn = lambda path, leaf: lookup[id(leaf)]  # noqa: E731

    def one(path, leaf):
        shape = tuple(getattr(leaf, "shape", ()))
        ax = axes_fn(path, leaf)
        if not shape or ax is None:
            return NamedSharding(mesh, P())
        return NamedSharding(mesh, logical_to_spec(ax, mesh, rules, shape, strict=True, what=f"cache {path}"))

    return _map_with_path(one, cache)


# ----------------------------------------------------------------------------------------------------------------
# jit under a mesh
# ----------------------------------------------------------------------------------------------------------------

def sharded_jit(fn: Callable, mesh, rules: Rules | str = "tp", *, in_shardings=None, out_shardings=None,
                params_argnum: int | None = None, config=None, **jit_kwargs):
    """``jax.jit(fn)`` with in/out shardings whose trace runs inside ``sharding_context(mesh, rules)``.

    With ``params_argnum`` (and ``config``) that argument is a parameter tree placed by :func:`shard_params`; its
    padded Engram tables are sliced back before ``fn`` sees them. Any entry point (forward, prefill, decode step,
    train step) can be wrapped this way; the activation constraints and the expert-parallel MoE pick up the mesh.
    """
    rules = get_rules(rules)
    if params_argnum is not None and config is None:
        raise ValueError("sharded_jit: params_argnum needs config (to unpad Engram tables)")

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        if params_argnum is not None:
            args = list(args)
            args[params_argnum] = unpad_params(args[params_argnum], config)
        with sharding_context(mesh, rules):
            return fn(*args, **kwargs)

    return _MeshJit(jax.jit(traced, in_shardings=in_shardings, out_shardings=out_shardings, **jit_kwargs), mesh, rules)


class _MeshJit:
    """A jitted function whose calls / lowerings run inside its mesh + rules context."""

    def __init__(self, jitted, mesh, rules):
        self.jitted, self.mesh, self.rules = jitted, mesh, rules

    def __call__(self, *args, **kwargs):
        with sharding_context(self.mesh, self.rules):
            return self.jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with sharding_context(self.mesh, self.rules):
            return self.jitted.lower(*args, **kwargs)

    def eval_shape(self, *args, **kwargs):
        with sharding_context(self.mesh, self.rules):
            return self.jitted.eval_shape(*args, **kwargs)


def sharded_forward(config, mesh, rules: Rules | str = "tp", options=None, *, batch: int | None = None,
                    include_dspark: bool = False, **forward_kwargs):
    """A jitted ``forward(params, tokens, engram_ids) -> logits`` sharded over ``mesh``.

    Parameters must come from :func:`shard_params` (or match :func:`param_shardings`); tokens / Engram ids are split
    over the batch axes, logits come back as [B, T, V] split over batch and vocabulary.
    """
    from dsv41_jax.model.forward import ForwardOptions, forward

    rules = get_rules(rules)
    options = ForwardOptions() if options is None else options
    check_model(config, mesh, rules, include_dspark=include_dspark)
    if batch is not None:
        check_batch(batch, mesh, rules)
    p_sh = param_shardings(config, mesh, rules, include_dspark=include_dspark)
    tok = NamedSharding(mesh, logical_to_spec(("batch", "seq"), mesh, rules))
    eng = NamedSharding(mesh, logical_to_spec(("batch", "seq", None, None), mesh, rules))
    out = NamedSharding(mesh, logical_to_spec(("batch", "seq", "vocab"), mesh, rules))

    def run(params, tokens, engram_ids):
        return forward(params, tokens, config=config, engram_ids=engram_ids, options=options, **forward_kwargs)

    jitted = sharded_jit(run, mesh, rules, in_shardings=(p_sh, tok, None if not config.engram_layer_ids else eng),
                         out_shardings=out if not forward_kwargs else None, params_argnum=0, config=config)

    def call(params, tokens, engram_ids=None):
        check_batch(int(tokens.shape[0]), mesh, rules)
        return jitted(params, tokens, engram_ids)

    call.jitted = jitted
    return call


def describe_shardings(tree) -> list[str]:
    """``path  shape  spec`` lines for a tree of arrays / ShapeDtypeStructs with shardings (debugging, reports)."""
    lines = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        spec = getattr(getattr(leaf, "sharding", None), "spec", None)
        lines.append(f"{key}  {tuple(leaf.shape)}  {spec}")
    return lines


__all__ = ["param_partition_specs", "param_shardings", "abstract_sharded_params", "shard_params", "pad_params",
           "unpad_params", "batch_sharding", "cache_shardings", "sharded_jit", "sharded_forward",
           "describe_shardings", "padded_rows", "MeshError", "Any"]
