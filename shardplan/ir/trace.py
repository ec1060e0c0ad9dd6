"""Trace a train step: its jaxpr, which arguments are state, batch or other, and which
outputs carry the state back."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import numpy as np

from shardplan import fingerprint
from shardplan.ir import remat as remat_mod
from shardplan.ir.graph import Role
from shardplan.ir.lift import ArgInfo
from shardplan.options import path_str


@dataclasses.dataclass(frozen=True)
class TracedStep:
    closed_jaxpr: object
    arg_info: ArgInfo
    in_tree: object           # treedef of the positional args tuple
    out_tree: object
    in_avals: tuple           # flat ShapeDtypeStructs
    out_avals: tuple
    state_argnums: tuple[int, ...]
    arg_leaf_counts: tuple[int, ...]
    input_paths: tuple[str, ...] = ()  # '/'-joined, argument index first (options.path_str)
    remat: remat_mod.Remat | None = None
    """Set on the step `rematerialized` gives: what the rewrite did (None: the step as traced)."""

    @functools.cached_property
    def jaxpr_digest(self) -> str:
        """Hash of the jaxpr printed without source information (printing a large step takes
        about a second, so it is done once per trace)."""
        return fingerprint.digest(fingerprint.jaxpr_text(self.closed_jaxpr))

    @functools.cached_property
    def rematerialized(self) -> TracedStep | None:
        """This step with its scanned layers rematerialized (shardplan.ir.remat), or None
        where no scan pair is recognised; rewritten once per trace. Inputs, outputs and their
        roles are the step's own."""
        if self.remat is not None:
            return self
        r = remat_mod.rematerialize(self.closed_jaxpr)
        return dataclasses.replace(self, closed_jaxpr=r.closed_jaxpr, remat=r) if r.pairs else None


def abstractify(x):
    """ShapeDtypeStruct of an array-like leaf (arrays keep no sharding: the plan decides)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x) if not hasattr(x, "dtype") else x.dtype)


def _signature(tree) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves)


def _is_key(leaf) -> bool:
    return jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def trace(fn, args: Sequence, state_argnums: Sequence[int] | None = None,
          batch_argnums: Sequence[int] | None = None) -> TracedStep:
    """Trace `fn(*args)` on abstract values and classify its inputs and outputs.

    State arguments are those whose pytree, shapes and dtypes equal an element of the output
    tuple (the new state), unless `state_argnums` says; the batch is every other argument's
    array leaves except PRNG keys and scalars, unless `batch_argnums` says.
    """
    args = tuple(args)
    abstract = jax.tree_util.tree_map(abstractify, args)
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*abstract)
    out_elems = out_shape if isinstance(out_shape, tuple) else (out_shape,)

    arg_sigs = [_signature(a) for a in abstract]
    out_sigs = [_signature(o) for o in out_elems]
    if state_argnums is None:
        state_argnums = tuple(i for i, s in enumerate(arg_sigs) if s in out_sigs and s[1])
    state_argnums = tuple(sorted(state_argnums))
    for i in state_argnums:
        if not 0 <= i < len(args):
            raise ValueError(f"state_argnums has {i}, but the step takes {len(args)} arguments")

    counts = [len(s[1]) for s in arg_sigs]
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    roles: list[Role] = []
    for i, a in enumerate(abstract):
        for leaf in jax.tree_util.tree_leaves(a):
            if i in state_argnums:
                roles.append(Role.STATE)
            elif batch_argnums is not None:
                roles.append(Role.BATCH if i in batch_argnums else Role.OTHER)
            else:
                roles.append(Role.OTHER if _is_key(leaf) or len(leaf.shape) == 0 else Role.BATCH)

    # Each state argument is tied to the first unclaimed output element with its signature.
    out_counts = [len(s[1]) for s in out_sigs]
    out_starts = np.concatenate([[0], np.cumsum(out_counts)]).astype(int)
    ties: list[int | None] = [None] * int(sum(out_counts))
    claimed: set[int] = set()
    for i in state_argnums:
        for j, s in enumerate(out_sigs):
            if j not in claimed and s == arg_sigs[i]:
                claimed.add(j)
                for k in range(out_counts[j]):
                    ties[out_starts[j] + k] = int(starts[i] + k)
                break

    in_paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
    in_names = tuple(jax.tree_util.keystr(p) for p in in_paths)
    out_names = tuple(jax.tree_util.keystr(p) for p, _ in
                      jax.tree_util.tree_flatten_with_path(out_elems)[0])
    info = ArgInfo(tuple(roles), tuple(ties), in_names, out_names)
    in_leaves, in_tree = jax.tree_util.tree_flatten(abstract)
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
    return TracedStep(closed, info, in_tree, out_tree, tuple(in_leaves), tuple(out_leaves),
                      state_argnums, tuple(counts), tuple(path_str(p) for p in in_paths))
