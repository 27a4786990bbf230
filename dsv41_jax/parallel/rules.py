"""Logical-axis rules: the one table that maps every logical axis name (parameters, activations, caches) to mesh
axes, plus the context that turns activation annotations into sharding constraints.

Parameters carry logical axis names in :func:`dsv41_jax.model.params.param_specs`; activations are annotated with
:func:`constrain` at layer boundaries. Without an active :func:`sharding_context` every annotation is a no-op, so
the unsharded forward is unchanged. Presets are data (``RULES``):

* ``tp``           — tensor parallel attention (heads, indexer heads, q LoRA, output groups over ``tensor``), experts
                     over ``expert``, expert / shared-MLP width over ``tensor``, batch over ``data`` x ``expert``.
* ``pod``          — as ``tp`` but experts over ``expert`` x ``tensor`` (full-width experts, wider EP) — TPU pods.
* ``dp_attention`` — data-parallel attention for decode: batch over every axis, attention weights replicated,
                     experts over ``expert`` x ``tensor``.

The single K=V latent (``kv_latent``) and the indexer key width are replicated in every preset. Engram table rows
are split over every mesh axis (tables are padded to a multiple of that; see :mod:`dsv41_jax.parallel.api`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Iterable, Mapping, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from dsv41_jax.parallel.mesh import AXES, MeshError

MeshAxes = tuple[str, ...]

# Every logical axis the model uses. Parameters: dsv41_jax.model.params; activations / caches: below.
PARAM_AXES = ("vocab", "embed", "q_lora", "q_heads", "kv_latent", "o_groups_rank", "o_group_in", "heads",
              "index_heads", "index_heads_w", "index_dim", "experts", "experts_r", "expert_mlp", "mlp", "hc_embed",
              "engram_rows", "engram_kv", "dspark_ctx")
ACTIVATION_AXES = ("batch", "seq", "streams", "cache_seq", "tokens")


@dataclasses.dataclass(frozen=True)
class Rules:
    """logical axis -> tuple of mesh axes (empty = replicated). ``lookup`` fails loudly on unknown names."""

    name: str
    table: tuple[tuple[str, MeshAxes], ...]

    def __post_init__(self):
        names = [k for k, _ in self.table]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise MeshError(f"rules {self.name!r}: logical axes {dup} appear twice")
        missing = sorted(set(PARAM_AXES + ACTIVATION_AXES) - set(names))
        if missing:
            raise MeshError(f"rules {self.name!r}: no rule for logical axes {missing}")
        for k, v in self.table:
            bad = [a for a in v if a not in AXES]
            if bad:
                raise MeshError(f"rules {self.name!r}: logical axis {k!r} maps to unknown mesh axes {bad}")

    @property
    def mapping(self) -> dict[str, MeshAxes]:
        return dict(self.table)

    def lookup(self, logical: str | None) -> MeshAxes:
        if logical is None:
            return ()
        m = self.mapping
        if logical not in m:
            raise MeshError(f"rules {self.name!r}: unknown logical axis {logical!r}; known: {sorted(m)}")
        return m[logical]

    def replace(self, name: str | None = None, **overrides: Sequence[str] | str | None) -> "Rules":
        """A copy with some logical axes remapped, e.g. ``rules.replace(vocab=None, experts=("expert",))``."""
        m = self.mapping
        for k, v in overrides.items():
            if k not in m:
                raise MeshError(f"rules {self.name!r}: unknown logical axis {k!r}")
            m[k] = _axes(v)
        return Rules(name or f"{self.name}+", tuple(m.items()))


def _axes(v) -> MeshAxes:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    return tuple(v)


def _table(**kw) -> tuple[tuple[str, MeshAxes], ...]:
    return tuple((k, _axes(v)) for k, v in kw.items())


_TP = dict(
    # activations / caches
    batch=("data", "expert"), seq=None, streams=None, cache_seq=None, tokens=("data", "expert"),
    # embeddings and head
    vocab="tensor", embed=None, hc_embed=None,
    # attention: heads / q LoRA / output groups over tensor; the single K=V latent replicated
    q_lora="tensor", q_heads="tensor", heads="tensor", kv_latent=None, o_groups_rank="tensor", o_group_in=None,
    index_heads="tensor", index_heads_w="tensor", index_dim=None,
    # MoE: experts over expert, expert width over tensor, router replicated
    experts="expert", experts_r=None, expert_mlp="tensor", mlp="tensor",
    # Engram: rows over every axis, the projection replicated
    engram_rows=("data", "expert", "tensor"), engram_kv=None,
    dspark_ctx=None,
)

RULES: dict[str, Rules] = {
    "tp": Rules("tp", _table(**_TP)),
    "pod": Rules("pod", _table(**{**_TP, "experts": ("expert", "tensor"), "expert_mlp": None})),
    "dp_attention": Rules("dp_attention", _table(**{
        **_TP, "batch": ("data", "expert", "tensor"), "tokens": ("data", "expert", "tensor"),
        "q_lora": None, "q_heads": None, "heads": None, "o_groups_rank": None, "index_heads": None,
        "index_heads_w": None, "vocab": None, "mlp": None, "experts": ("expert", "tensor"), "expert_mlp": None})),
}


def get_rules(rules: "Rules | str") -> Rules:
    if isinstance(rules, Rules):
        return rules
    if rules not in RULES:
        raise MeshError(f"unknown rules preset {rules!r}; available: {sorted(RULES)}")
    return RULES[rules]


# ----------------------------------------------------------------------------------------------------------------
# logical axes -> PartitionSpec
# ----------------------------------------------------------------------------------------------------------------

def mesh_axes_for(logical: str | None, mesh, rules: Rules) -> MeshAxes:
    """The mesh axes a logical axis shards over on this mesh (axes the mesh lacks or of size 1 dropped)."""
    return tuple(a for a in rules.lookup(logical) if a in mesh.shape and mesh.shape[a] > 1)


def logical_to_spec(axes: Sequence[str | None], mesh, rules: Rules, shape: Sequence[int] | None = None, *,
                    strict: bool = True, what: str = "array") -> P:
    """PartitionSpec for an array whose dims carry logical names ``axes``.

    A mesh axis is used at most once (the first dim that asks for it wins). With ``shape``, a dim that the mesh
    axes do not divide raises :class:`MeshError` naming the array, logical axis, mesh axes and sizes (``strict``),
    or — for activations (``strict=False``) — keeps only the leading mesh axes that divide it.
    """
    if shape is not None and len(shape) != len(axes):
        raise MeshError(f"{what}: {len(axes)} logical axes {tuple(axes)} for a rank-{len(shape)} shape {tuple(shape)}")
    used: set[str] = set()
    out = []
    for i, name in enumerate(axes):
        picked = [a for a in mesh_axes_for(name, mesh, rules) if a not in used]
        if shape is not None and picked:
            dim = int(shape[i])
            size = math.prod(mesh.shape[a] for a in picked)
            if dim % size:
                if strict:
                    raise MeshError(
                        f"{what}: dimension {i} (logical axis {name!r}) has size {dim}, which mesh axes "
                        f"{tuple(picked)} (total size {size}; mesh {dict(mesh.shape)}) do not divide")
                while picked and dim % math.prod(mesh.shape[a] for a in picked):
                    picked.pop()
        used.update(picked)
        out.append(None if not picked else picked[0] if len(picked) == 1 else tuple(picked))
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def named_sharding(axes, mesh, rules, shape=None, *, strict=True, what="array") -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, mesh, get_rules(rules), shape, strict=strict, what=what))


# ----------------------------------------------------------------------------------------------------------------
# model-level divisibility checks (clear errors before anything is traced)
# ----------------------------------------------------------------------------------------------------------------

def model_dimensions(config, *, include_dspark: bool = False) -> list[tuple[str, str, int]]:
    """(logical axis, config field, size) for every model dimension a mesh axis may split."""
    c = config
    dims = [
        ("heads", "num_attention_heads", c.num_attention_heads),
        ("q_heads", "num_attention_heads", c.num_attention_heads),
        ("index_heads", "index_n_heads", c.index_n_heads),
        ("index_heads_w", "index_n_heads", c.index_n_heads),
        ("o_groups_rank", "o_groups", c.o_groups),
        ("q_lora", "q_lora_rank", c.q_lora_rank),
        ("experts", "n_routed_experts", c.n_routed_experts),
        ("expert_mlp", "moe_intermediate_size", c.moe_intermediate_size),
        ("mlp", "moe_intermediate_size", c.moe_intermediate_size),
        ("vocab", "vocab_size", c.vocab_size),
        ("embed", "hidden_size", c.hidden_size),
        ("kv_latent", "head_dim", c.head_dim),
        ("index_dim", "index_head_dim", c.index_head_dim),
    ]
    if include_dspark and c.num_nextn_predict_layers > 0:
        dims.append(("experts", "dspark_n_routed_experts", c.dspark_n_routed_experts))
    return dims


def check_model(config, mesh, rules: Rules | str, *, include_dspark: bool = False) -> None:
    """Raise :class:`MeshError` if a mesh axis does not divide a model dimension it shards (heads, experts,
    vocabulary, ...). The message names the mesh axis, its size, the logical axis and the config field."""
    rules = get_rules(rules)
    for logical, field, size in model_dimensions(config, include_dspark=include_dspark):
        axes = mesh_axes_for(logical, mesh, rules)
        n = math.prod(mesh.shape[a] for a in axes)
        if axes and size % n:
            names = " x ".join(f"'{a}' (size {mesh.shape[a]})" for a in axes)
            raise MeshError(f"mesh axis {names} does not divide {field} = {size}: rules {rules.name!r} shard "
                            f"logical axis {logical!r} over {axes}; pick mesh sizes that divide {size}")


def check_batch(batch: int, mesh, rules: Rules | str, *, logical: str = "batch") -> None:
    rules = get_rules(rules)
    axes = mesh_axes_for(logical, mesh, rules)
    n = math.prod(mesh.shape[a] for a in axes)
    if axes and batch % n:
        names = " x ".join(f"'{a}' (size {mesh.shape[a]})" for a in axes)
        raise MeshError(f"batch size {batch} is not divisible by mesh axis {names}: rules {rules.name!r} split "
                        f"the batch over {axes} (total {n}); use a batch that is a multiple of {n}")


# ----------------------------------------------------------------------------------------------------------------
# the sharding context: activation constraints and the expert-parallel MoE read it at trace time
# ----------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ShardingContext:
    mesh: jax.sharding.Mesh
    rules: Rules

    def spec(self, axes, shape=None, *, strict=False) -> P:
        return logical_to_spec(axes, self.mesh, self.rules, shape, strict=strict)

    def sharding(self, axes, shape=None, *, strict=False) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes, shape, strict=strict))

    def axes(self, logical: str) -> MeshAxes:
        return mesh_axes_for(logical, self.mesh, self.rules)


_CONTEXT: contextvars.ContextVar[ShardingContext | None] = contextvars.ContextVar("dsv41_sharding", default=None)


@contextlib.contextmanager
def sharding_context(mesh, rules: Rules | str = "tp"):
    """Activate ``mesh`` + ``rules`` for tracing: :func:`constrain` and ``moe_impl="expert_parallel"`` use them.

    Enter it around the call of a jitted function (or inside its trace); ``sharded_jit`` does both. It places no
    data by itself. JAX's jit caches are keyed by the mesh but not by the rules: to switch rules presets on one
    mesh, use fresh jitted functions (``sharded_jit`` makes one per call).
    """
    token = _CONTEXT.set(ShardingContext(mesh, get_rules(rules)))
    try:
        # Outside jit also set JAX's mesh context: jit caches are keyed by it, so a function traced under one mesh
        # is never reused under another. (Inside a trace JAX refuses set_mesh; the outer call already keyed it.)
        try:
            mesh_cm = jax.set_mesh(mesh)
        except ValueError:
            mesh_cm = contextlib.nullcontext()
        with mesh_cm:
            yield _CONTEXT.get()
    finally:
        _CONTEXT.reset(token)


def current() -> ShardingContext | None:
    return _CONTEXT.get()


def constrain(x, axes: Sequence[str | None]):
    """``with_sharding_constraint`` by logical axis names; a no-op without an active sharding context.

    Dims the mapped mesh axes do not divide fall back to fewer (or no) mesh axes instead of failing — activation
    annotations are hints; inputs and parameters are checked strictly at the sharded entry points.
    """
    ctx = _CONTEXT.get()
    if ctx is None or x is None:
        return x
    return jax.lax.with_sharding_constraint(x, ctx.sharding(axes, x.shape))


def constrain_tree(tree, axes_tree):
    ctx = _CONTEXT.get()
    if ctx is None:
        return tree
    return jax.tree.map(lambda x, a: constrain(x, a), tree, axes_tree, is_leaf=lambda a: isinstance(a, tuple))


def rules_table_markdown(rules: Iterable[Rules] | None = None) -> str:
    """The rules presets side by side as a Markdown table (README / reports)."""
    rules = list(RULES.values()) if rules is None else list(rules)
    names = [k for k, _ in rules[0].table]
    head = "| logical axis | " + " | ".join(r.name for r in rules) + " |"
    sep = "|---" * (len(rules) + 1) + "|"
    rows = [f"| `{n}` | " + " | ".join(" × ".join(r.mapping[n]) or "—" for r in rules) + " |" for n in names]
    return "\n".join([head, sep, *rows])


def as_mapping(rules: Rules) -> Mapping[str, MeshAxes]:
    return rules.mapping
