"""Device mesh and partition rules for the decoder, its KV cache and its activations.

One mesh with three named axes:
  data    pure data parallelism (replicated weights, split batch)
  fsdp    batch split too, and weights sharded along their model dimension (ZeRO-3 style: XLA
          all-gathers a weight where it is used)
  tensor  Megatron-style tensor parallelism: q/k/v and gate/up split by output columns, o/down by
          input rows, the vocabulary split in the embedding and lm_head

Axes are ``AxisType.Auto``: shardings are set on parameters, inputs and a few activations, and XLA's
propagation places everything else (``jax.make_mesh`` would default to Explicit axes, where every
op's output sharding must be spelled out).

Parameters are matched by name: a path such as ``layers/3/self_attn/q_proj/kernel`` is searched
with each rule's regex in order, and the first match gives the ``PartitionSpec`` of the array's
trailing dimensions (leading extra dimensions, e.g. the [L] axis of ``scan_layers``, stay
unsharded). A mesh axis that does not divide its dimension is dropped for that array, so small
models (or few kv heads) still load on a large mesh.
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
# The batch dimension of inputs, activations and the KV cache is split over both data axes.
BATCH_AXES = ("data", "fsdp")

# (regex on the parameter path, spec of the trailing dims). Shapes follow decoder.py:
# kernels are [in, out], the embedding is [V, D].
DEFAULT_RULES: tuple[tuple[str, P], ...] = (
    (r"embed_tokens/embedding$", P("tensor", "fsdp")),  # [V, D] vocab-parallel
    (r"self_attn/(q|k|v)_proj/kernel$", P("fsdp", "tensor")),  # [D, heads*Hd] column-parallel
    (r"self_attn/(q|k|v)_proj/bias$", P("tensor")),
    (r"self_attn/o_proj/kernel$", P("tensor", "fsdp")),  # [H*Hd, D] row-parallel
    (r"self_attn/o_proj/bias$", P(None)),
    (r"mlp/(gate|up)_proj/kernel$", P("fsdp", "tensor")),  # [D, F] column-parallel
    (r"mlp/(gate|up)_proj/bias$", P("tensor")),
    (r"mlp/down_proj/kernel$", P("tensor", "fsdp")),  # [F, D] row-parallel
    (r"mlp/down_proj/bias$", P(None)),
    (r"norm/scale$", P(None)),  # RMSNorm gains (input_layernorm, post_attention_layernorm, norm)
    (r"lm_head/kernel$", P("fsdp", "tensor")),  # [D, V] vocab-parallel logits
    (r"lora/lora_(a|b)$", P()),  # LoRA adapters [in, r] / [r, out]: small, replicated
    (r"score/kernel$", P("fsdp", None)),  # value head [D, 1]
    (r"score/bias$", P(None)),
)

Rules = Sequence[tuple[str, P]]


# ---------------------------------------------------------------------------------------------------
# Mesh


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, *, devices: Sequence[Any] | None = None) -> Mesh:
    """A ``Mesh`` of shape (data, fsdp, tensor) with Auto axes.

    One size may be -1: it takes all the devices the others leave. With fewer mesh slots than
    devices, the first ``data * fsdp * tensor`` devices are used.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"make_mesh sizes must be positive, with at most one -1 (fill); got {dict(zip(MESH_AXES, sizes))}")
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if len(devices) % known:
            raise ValueError(f"cannot fill the -1 axis: {len(devices)} devices are not a multiple of {known}")
        sizes[sizes.index(-1)] = len(devices) // known
    needed = math.prod(sizes)
    if needed > len(devices):
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes))} needs {needed} devices but only {len(devices)} are visible; on CPU "
            "set XLA_FLAGS=--xla_force_host_platform_device_count=N before jax is imported"
        )
    return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices[:needed])


# ---------------------------------------------------------------------------------------------------
# Parameters


def path_to_name(path) -> str:
    """Normalise a parameter path to 'a/b/0/c'.

    Accepts a string with '/' or '.' separators, a tuple of keys, or a jax key path (the trailing
    '.value' of an NNX Variable is dropped).
    """
    if isinstance(path, str):
        parts = re.split(r"[/.]", path)
    else:
        parts = []
        for key in path:
            for attr in ("key", "name", "idx"):
                if hasattr(key, attr):
                    key = getattr(key, attr)
                    break
            parts.append(str(key))
        if parts and parts[-1] == "value":
            parts = parts[:-1]
    return "/".join(p for p in parts if p != "")


def _fit(spec: P, shape: Sequence[int], mesh: Mesh) -> P:
    """Right-align spec to shape and drop mesh axes that do not divide their dimension."""
    spec = tuple(spec)
    if len(spec) > len(shape):
        raise ValueError(f"partition spec {P(*spec)} has more dimensions than the array shape {tuple(shape)}")
    spec = (None,) * (len(shape) - len(spec)) + spec
    out = []
    for dim, axes in zip(shape, spec):
        names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
        names = tuple(a for a in names if a in mesh.shape)
        # Keep the longest prefix of axes whose product divides the dimension.
        while names and dim % math.prod(mesh.shape[a] for a in names):
            names = names[:-1]
        out.append(None if not names else names[0] if len(names) == 1 else names)
    return P(*out)


def _rule_spec(name: str, rules: Rules) -> P | None:
    """The spec of the first rule whose regex matches ``name`` (None: no rule does)."""
    for pattern, spec in rules:
        if re.search(pattern, name):
            return spec
    return None


def _axis_names(spec: P) -> set[str]:
    return {a for axes in tuple(spec) if axes is not None for a in (axes if isinstance(axes, tuple) else (axes,))}


def partition_spec(path, shape: Sequence[int], mesh: Mesh, rules: Rules = DEFAULT_RULES, *, strict: bool = True) -> P:
    """The ``PartitionSpec`` of the parameter at ``path`` with ``shape`` on ``mesh``.

    strict: an unmatched path raises (so a new parameter cannot silently end up replicated on every
    device); with strict=False it is replicated. Append ``(r".*", P())`` to the rules to replicate
    everything else on purpose.
    """
    name = path_to_name(path)
    spec = _rule_spec(name, rules)
    if spec is not None:
        return _fit(spec, shape, mesh)
    if strict:
        raise ValueError(
            f"no partition rule matches parameter {name!r} (shape {tuple(shape)}); add a (regex, PartitionSpec) "
            "rule for it, or (r'.*', PartitionSpec()) to replicate unmatched parameters"
        )
    return P(*([None] * len(shape)))


def replicated_axes(tree, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Where a rule shards along a mesh axis of size > 1 but the axis does not divide the dimension
    (so ``_fit`` replicated the array along it): ``{axis: [(parameter name, shape), ...]}``. Empty
    when every axis the rules name is used everywhere they name it."""
    found: dict[str, list[tuple[str, tuple[int, ...]]]] = {}

    def one(path, x):
        shape, name = tuple(np.shape(x)), path_to_name(path)
        spec = _rule_spec(name, rules)
        if spec is None:
            return
        wanted = {a for a in _axis_names(spec) if mesh.shape.get(a, 1) > 1}
        for axis in sorted(wanted - _axis_names(_fit(spec, shape, mesh))):
            found.setdefault(axis, []).append((name, shape))

    jax.tree_util.tree_map_with_path(one, tree)
    return found


def sharding_fn(mesh: Mesh, rules: Rules = DEFAULT_RULES, *, strict: bool = True) -> Callable[[Any, Sequence[int]], NamedSharding]:
    """``(path, shape) -> NamedSharding``, for loaders that place each tensor as they read it."""

    def fn(path, shape):
        return NamedSharding(mesh, partition_spec(path, shape, mesh, rules, strict=strict))

    return fn


def param_shardings(state, mesh: Mesh, rules: Rules = DEFAULT_RULES, *, strict: bool = True):
    """A pytree like ``state`` (e.g. ``nnx.state(model)``) with a ``NamedSharding`` per array."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, partition_spec(path, np.shape(x), mesh, rules, strict=strict)), state
    )


def shard_params(state, mesh: Mesh, rules: Rules = DEFAULT_RULES, *, strict: bool = True):
    """``state`` with every array placed by its rule."""
    return jax.device_put(state, param_shardings(state, mesh, rules, strict=strict))


# ---------------------------------------------------------------------------------------------------
# Batch, KV cache and activations


def batch_spec(shape: Sequence[int], mesh: Mesh) -> P:
    """Split the leading (batch) dim over ('data', 'fsdp'); everything else replicated."""
    lead = tuple(_fit(P(BATCH_AXES), tuple(shape[:1]), mesh))
    return P(*(lead + (None,) * (len(shape) - 1)))


def batch_sharding(x, mesh: Mesh):
    """NamedSharding(s) for a batch array or a pytree of them (leading dim = batch)."""
    return jax.tree.map(lambda a: NamedSharding(mesh, batch_spec(np.shape(a), mesh)), x)


def cache_shardings(cache, mesh: Mesh):
    """Shardings for a KV cache (k, v: [layers, B, kv_heads, S, head_dim]): rows over the batch axes,
    kv heads over 'tensor' (matching the column split of k_proj / v_proj)."""
    return jax.tree.map(
        lambda a: NamedSharding(mesh, _fit(P(None, BATCH_AXES, "tensor", None, None), np.shape(a), mesh)), cache
    )


def constrain_activations(x: jax.Array, mesh: Mesh | None = None) -> jax.Array:
    """Pin activations [B, T, D] (or [B, ...]) to batch-sharded, replicated over 'tensor'.

    Meant for the decoder's block boundaries (after the embedding and after each layer) so XLA keeps
    the residual stream in the Megatron layout instead of guessing. Uses ``mesh`` or the one set by
    ``jax.set_mesh``; with neither it returns x unchanged (single-device code pays nothing).
    """
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            return x
    spec = batch_spec(x.shape, mesh)
    target = NamedSharding(mesh, spec) if isinstance(mesh, Mesh) else spec
    return jax.lax.with_sharding_constraint(x, target)


def constrain_embedding_table(table: jax.Array) -> jax.Array:
    """The [V, D] embedding table, all-gathered over 'fsdp' for the lookup (vocab split kept).

    A lookup on the FSDP layout (D split over 'fsdp') yields rows split along D, which XLA cannot
    turn into the batch-split residual stream without replicating it; gathering the table's fsdp
    shards first (what FSDP does for every weight where it is used) lets each device look up its
    own rows. Identity without a mesh.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return table
    return jax.lax.with_sharding_constraint(table, _fit(P("tensor", None), table.shape, mesh))
