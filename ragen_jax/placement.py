"""Where a run's arrays live: one device mesh over the devices of every process.

A ``Placement`` is the run's mesh (``config.mesh``) plus the few operations that differ between one
process and several (multi-host GPU nodes, TPU pod slices):

  put(tree, shardings)   host or single-device values -> global arrays with those shardings
  fetch(tree)            global arrays -> NumPy on every process (replicated values are read
                         locally; batch-sharded ones are gathered, a collective every process joins)
  state_shardings(tree)  a train-state-like pytree -> the partition rules' shardings, leaf by leaf
  batch_shardings(tree)  leading (batch) dim over ('data', 'fsdp'), the rest replicated

With one process every operation is the plain single-controller one (``jax.device_put``,
``jax.device_get``). With several, every process runs the same program on its own share of each
array (SPMD); what one process alone must do (write TensorBoard, move a workdir aside) is guarded by
``is_main`` and followed by ``sync``.

Two meshes on disjoint processes (the asynchronous rollout on processes of its own,
``mesh.rollout_devices``): every process still runs every program, and one whose devices are all on
other processes is a no-op there that returns arrays without local shards. Arrays cross between the
two with ``send`` (a cross-host device-to-device transfer, no host round trip); a placement whose
``peer`` is the other mesh's devices ``fetch``es its arrays on every process by sending them over.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ragen_jax.models import sharding as sharding_lib


def _is_key(x) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


class Placement:
    """A mesh and the partition rules of the models that live on it."""

    def __init__(self, mesh: Mesh, rules: sharding_lib.Rules = sharding_lib.DEFAULT_RULES):
        self.mesh = mesh
        self.rules = tuple(rules)
        self.replicated = NamedSharding(mesh, P())
        # The devices of the other mesh when the two live on disjoint processes (``send``): what this
        # placement's ``fetch`` sends its arrays to, so that those processes read them too.
        self.peer: np.ndarray | None = None

    @classmethod
    def from_shape(cls, data: int = -1, fsdp: int = 1, tensor: int = 1, devices=None) -> "Placement":
        """The mesh of ``config.mesh`` over ``devices`` (default ``jax.devices()``: every process's)."""
        devices = list(jax.devices() if devices is None else devices)
        n = len(devices)
        try:
            mesh = sharding_lib.make_mesh(data, fsdp, tensor, devices=devices)
        except ValueError as e:
            where = (f"{n} devices over {jax.process_count()} processes" if jax.process_count() > 1
                     else f"{n} device{'s' if n != 1 else ''} ({jax.devices()[0].platform})")
            raise ValueError(f"mesh data={data}, fsdp={fsdp}, tensor={tensor} does not fit the {where}: {e}. "
                             "Set --config.mesh.data/fsdp/tensor so they multiply to the device count "
                             "(one of them may be -1)") from None
        if math.prod(mesh.shape.values()) != n:
            raise ValueError(f"mesh {dict(mesh.shape)} uses {math.prod(mesh.shape.values())} of the {n} devices; "
                             "the sizes must multiply to the device count (set one axis to -1 to take the rest)")
        return cls(mesh)

    # ------------------------------------------------------------------------------------------
    @property
    def num_processes(self) -> int:
        return jax.process_count()

    @property
    def is_main(self) -> bool:
        """The one process that writes logs, summaries and the workdir's own files."""
        return jax.process_index() == 0

    @property
    def batch_divisor(self) -> int:
        """Rows of a batch are split over data × fsdp devices: batch sizes should be multiples."""
        return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

    @property
    def describe(self) -> str:
        shape = " × ".join(f"{k} {v}" for k, v in self.mesh.shape.items())
        procs = f" over {self.num_processes} processes" if self.num_processes > 1 else ""
        n = self.mesh.size
        return f"mesh {shape} ({n} {jax.devices()[0].platform} device{'s' if n != 1 else ''}{procs})"

    # ------------------------------------------------------------------------------------------
    # Shardings

    def state_shardings(self, tree, *, strict: bool = False):
        """A ``NamedSharding`` per array of ``tree``, by the partition rules on its path.

        The rules are anchored at the end of the path, so an optimizer moment
        (``opt_state/1/0/mu/layers/0/mlp/up_proj/kernel``) is sharded like its parameter; scalars,
        counters and keys are replicated. ``strict`` raises for an array no rule matches (use it on
        parameter trees, so a new parameter is never silently replicated on every device).
        """
        def one(path, x):
            shape = np.shape(x) if not _is_key(x) else x.shape
            spec = sharding_lib.partition_spec(path, shape, self.mesh, self.rules, strict=strict) if shape else P()
            return NamedSharding(self.mesh, spec)

        return jax.tree_util.tree_map_with_path(one, tree)

    def batch_shardings(self, tree):
        """Leading dim of every array over ('data', 'fsdp') when it divides, else replicated."""
        return jax.tree.map(lambda x: NamedSharding(self.mesh, sharding_lib.batch_spec(np.shape(x), self.mesh))
                            if np.ndim(x) else self.replicated, tree)

    def create(self, make: Callable[[Any], Any], seed: int):
        """``make(nnx.Rngs(seed))`` (an ``nnx.Module`` constructor) with every array created in its shards.

        The module is traced abstractly first (``nnx.eval_shape``: no memory), then initialised by
        one program whose outputs have the rules' shardings, so a 7B critic is never materialised
        on one device. The values are those of ``make(nnx.Rngs(seed))`` run eagerly (same RNG
        streams) up to float rounding: the compiled initialisers may differ from the op-by-op ones
        in the last bit.

        The seed's key is an argument of that program, not a constant in it: with the key constant,
        XLA's GPU compiler folds the random initialisers at compile time (measured on an H200: 113 s
        to compile a Qwen2.5-0.5B-shaped decoder's initialiser).
        """
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: make(nnx.Rngs(seed))))
        shardings = self.state_shardings(abstract)
        init = self.jit(lambda key: nnx.split(make(nnx.Rngs(key)))[1], out_shardings=shardings)
        return nnx.merge(graphdef, init(jax.random.key(seed)))

    # ------------------------------------------------------------------------------------------
    # Moving data

    def put(self, tree, shardings):
        """``tree`` as global arrays with ``shardings`` (a matching pytree, or one sharding for all).

        Values given on the host (NumPy) or on one local device must be the same on every process
        (they are: everything here derives from the config and the seed); each process then keeps
        only the shards its devices hold.
        """
        if isinstance(shardings, jax.sharding.Sharding):
            shardings = jax.tree.map(lambda _: shardings, tree)
        return jax.tree.map(self._put_one, tree, shardings)

    def put_replicated(self, tree):
        return self.put(tree, self.replicated)

    def put_batch(self, tree):
        return self.put(tree, self.batch_shardings(tree))

    def _put_one(self, x, sharding: NamedSharding):
        if x is None:
            return None
        if _is_key(x):
            impl = jax.random.key_impl(x)
            data = self._put_one(jax.random.key_data(x), sharding)
            return jax.random.wrap_key_data(data, impl=impl)
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x
        if self.num_processes == 1:
            return jax.device_put(x, sharding)
        if isinstance(x, jax.Array) and not x.is_fully_addressable:  # already global: reshard
            return jax.jit(lambda a: a, out_shardings=sharding)(x)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index], dtype=host.dtype)

    def fetch(self, tree):
        """NumPy copies of every array (PRNG keys: local key arrays), on every process (a collective
        when arrays are sharded across processes: every process must call it, in the same order)."""
        return jax.tree.map(self._fetch_one, tree)

    def _fetch_one(self, x):
        if not isinstance(x, jax.Array):
            return x
        if _is_key(x):  # a key stays a key (on this process's default device)
            return jax.random.wrap_key_data(self._fetch_one(jax.random.key_data(x)), impl=jax.random.key_impl(x))
        if self.peer is not None and x.sharding.device_set == self._devices:  # not on the peer's processes
            return self._fetch_across(x)
        if x.is_fully_addressable:
            return np.asarray(jax.device_get(x))
        if x.sharding.is_fully_replicated:
            return np.asarray(x.addressable_data(0))

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    def take_from_peer(self, tree, shardings):
        """``tree``, global arrays on the peer mesh (``peer``: disjoint processes), as arrays with
        ``shardings`` (a matching pytree) on this mesh: ``send`` leaf by leaf (PRNG keys too). Every
        process calls it, in the same order."""
        def one(x, sharding):
            if _is_key(x):
                data = send(jax.random.key_data(x), sharding)
                return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
            return send(x, sharding)

        return jax.tree.map(one, tree, shardings)

    # Checkpoints of a run on two disjoint process sets: orbax writes arrays that span every process.
    def _other_side(self, sharding: NamedSharding) -> NamedSharding:
        """``sharding`` (on this mesh or the peer's) laid out the same way over the other mesh's devices."""
        return _on_devices(sharding, self.peer if sharding.device_set == self._devices else self.mesh.devices)

    def _spanning_sharding(self, sharding: NamedSharding) -> NamedSharding:
        """``sharding`` (on this mesh or the peer's) over both meshes: a leading ``side`` axis, the
        array whole on each side (its own side first), laid out there as ``sharding`` lays it."""
        there = self._other_side(sharding).mesh.devices
        mesh = Mesh(np.stack([sharding.mesh.devices, there]), ("side",) + tuple(sharding.mesh.axis_names))
        return NamedSharding(mesh, sharding.spec)

    def _spans(self, x) -> bool:
        return (self.peer is not None and isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)
                and x.sharding.device_set in (self._devices, set(np.asarray(self.peer).flat)))

    def spanning(self, tree):
        """Every array of ``tree`` on one side, as an array over both (``_spanning_sharding``), so that
        a checkpoint of a two-sided run is a multi-process one orbax writes; no-op without a peer."""
        def one(x):
            if not self._spans(x):
                return x
            copy = send(x, self._other_side(x.sharding))
            local = [s.data for a in (x, copy) for s in a.addressable_shards]
            return jax.make_array_from_single_device_arrays(x.shape, self._spanning_sharding(x.sharding), local,
                                                            dtype=x.dtype)

        return jax.tree.map(one, tree)

    def spanning_target(self, abstract):
        """``ShapeDtypeStruct``s of arrays on one side as ``spanning`` saves them (orbax restores into it)."""
        def one(a):
            if self.peer is None or not isinstance(getattr(a, "sharding", None), NamedSharding):
                return a
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self._spanning_sharding(a.sharding))

        return jax.tree.map(one, abstract)

    def one_side(self, tree, like):
        """Arrays restored over both sides (``spanning_target``) back on ``like``'s side alone."""
        def one(x, target):
            if self.peer is None or not isinstance(getattr(target, "sharding", None), NamedSharding):
                return x
            mine = target.sharding.device_set
            local = [s.data for s in x.addressable_shards if s.device in mine]
            return jax.make_array_from_single_device_arrays(x.shape, target.sharding, local, dtype=x.dtype)

        return jax.tree.map(one, tree, like)

    @property
    def _devices(self) -> set:
        return set(self.mesh.devices.flat)

    def _fetch_across(self, x):
        """``x`` (on this mesh's processes) as NumPy on every process: replicated on this mesh, sent to
        the peer's devices, and read where each process holds a copy (a collective of every process)."""
        whole = x if x.sharding == self.replicated else jax.jit(lambda a: a, out_shardings=self.replicated)(x)
        there = send(whole, self._other_side(whole.sharding))
        local = whole if jax.process_index() in _processes(whole.sharding) else there
        return np.asarray(local.addressable_data(0))

    # ------------------------------------------------------------------------------------------
    # Processes

    def sync(self, name: str) -> None:
        """Every process waits here until all have arrived (no-op with one process)."""
        if self.num_processes > 1:
            multihost_utils.sync_global_devices(name)

    def broadcast(self, value: Any) -> Any:
        """The main process's ``value`` (a small pytree of numbers), on every process."""
        if self.num_processes == 1:
            return value

        return multihost_utils.broadcast_one_to_all(value)

    def jit(self, fn: Callable, **kwargs) -> Callable:
        """``jax.jit(fn, **kwargs)`` whose trace sees this mesh (``jax.sharding.get_abstract_mesh``),
        so the decoder's activation constraints apply inside it."""
        abstract = self.mesh.abstract_mesh

        def traced(*args, **kw):
            with jax.sharding.use_abstract_mesh(abstract):
                return fn(*args, **kw)

        traced.__name__ = getattr(fn, "__name__", "fn")
        return jax.jit(traced, **kwargs)


def _processes(sharding) -> frozenset:
    return frozenset(d.process_index for d in sharding.device_set)


def _on_devices(sharding: NamedSharding, devices: np.ndarray) -> NamedSharding:
    """``sharding``'s layout (mesh shape, axis names, spec) over ``devices`` (as many as its mesh has)."""
    mesh = sharding.mesh
    if np.size(devices) != mesh.size:
        raise ValueError(f"cannot lay a {mesh.size}-device mesh's array over {np.size(devices)} devices: the two "
                         "meshes of a run on disjoint processes need the same number of devices")
    return NamedSharding(Mesh(np.asarray(devices).reshape(mesh.devices.shape), mesh.axis_names), sharding.spec)


def send(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``x`` with ``sharding``, whose devices are on processes that hold none of ``x``'s.

    A cross-host transfer (JAX's ``device_put`` between process sets: NCCL/ICI on GPUs and TPUs, the
    DCN socket of ``jax_cross_host_transfer_socket_address`` on CPUs) moves each shard to the device
    of the same place in the other mesh, keeping ``x``'s layout; the destination's processes then
    lay it out as ``sharding`` asks (a program on their devices). Every process calls it, in the
    same order; the two meshes have the same number of devices.
    """
    if not isinstance(x.sharding, NamedSharding):
        raise TypeError(f"send needs an array laid out on a mesh (a NamedSharding), got {x.sharding}")
    hop = _on_devices(x.sharding, sharding.mesh.devices)
    y = jax.device_put(x, hop)
    return y if hop == sharding else jax.jit(lambda a: a, out_shardings=sharding)(y)


def single_device() -> Placement:
    """A one-device mesh (the first device): what a run without a ``mesh`` section gets."""
    return Placement(sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
