"""The report's "use this plan" snippet: the code that loads plan.json and calls the planned
step with its own arguments, named by its signature, the state donated
(tests/test_report.py::test_the_use_this_plan_snippet_runs_for_a_zoo_model runs it)."""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Sequence

from shardplan.plan import Plan


@dataclasses.dataclass(frozen=True)
class StepCall:
    """How the planned step is called: its arguments' names (from its signature), which are
    state (donated in the snippet), and where the step and its arguments come from."""

    args: tuple[str, ...]
    state_argnums: tuple[int, ...] | None = None
    source: tuple[str, ...] = ()
    """Lines that bind `train_step` and the arguments (a zoo model's get_model call); empty:
    the user binds them."""

    @classmethod
    def of(cls, fn, num_args: int, state_argnums=None, source: Sequence[str] = ()) -> StepCall:
        """The call of `fn` with `num_args` positional arguments, named as its signature names
        them (arguments a `*args` parameter takes are named after it: extra0, extra1, ...)."""
        names: list[str] = []
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            params = []
        rest = None
        for p in params:
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                names.append(p.name)
            elif p.kind is p.VAR_POSITIONAL:
                rest = p.name
                break
        names = names[:num_args]
        base = rest or "arg"
        names += [f"{base}{i}" for i in range(num_args - len(names))]
        state = None if state_argnums is None else tuple(state_argnums)
        return cls(tuple(names), state, tuple(source))


def _top_level(names: Sequence[str], specs: Sequence) -> dict[int, dict[str, int]]:
    """Leaf paths and ranks by argument (or output) index: '[1][0].mu[...]' -> 1: {...: 2}."""
    out: dict[int, dict[str, int]] = {}
    for n, s in zip(names, specs):
        m = re.match(r"\[(\d+)\]", n)
        if m:
            out.setdefault(int(m.group(1)), {})[n[m.end():]] = s.ndim
    return out


def result_names(plan: Plan, args: Sequence[str], state_argnums=None) -> list[str]:
    """Names for the step's outputs: an output with the pytree and ranks of a state argument
    (any argument when the state is not known) is that argument's new value, the one scalar
    output left is the loss, others are out<k>."""
    ins = _top_level(plan.input_names, plan.input_specs)
    outs = _top_level(plan.output_names, plan.output_specs)
    state = range(len(args)) if state_argnums is None else state_argnums
    names, used = [], set()
    for k in range(max(outs, default=-1) + 1):
        same = [i for i in sorted(set(state) & set(ins)) if ins[i] == outs.get(k)
                and i < len(args) and i not in used]
        if same:
            i = k if k in same else same[0]
            used.add(i)
            names.append(args[i])
        else:
            names.append(f"out{k}")
    scalars = [k for k, n in enumerate(names) if n == f"out{k}" and outs.get(k) == {"": 0}]
    if len(scalars) == 1 and "loss" not in names:
        names[scalars[0]] = "loss"
    return names


def use_this_plan(plan: Plan, call: StepCall | None = None) -> list[str]:
    """The report's "use this plan" section: the code that loads plan.json and runs the step
    with it, calling the step with its own arguments (`call`; without it, `*args`)."""
    names, sizes = plan.mesh.names, plan.mesh.sizes
    if call is None:
        donate, binds, result, given = "", [], "outputs", "*args"
        where = ["# train_step: the step this plan was made for; args: its arguments, as arrays"]
    else:
        state = call.state_argnums
        donate = f", donate_argnums={tuple(state)}" if state else ""
        given = ", ".join(call.args)
        outs = result_names(plan, call.args, state)
        result = ", ".join(outs) if outs else "outputs"
        if len(outs) == 1:
            result += ","
        binds = list(call.source)
        where = ([] if binds else
                 [f"# train_step({given}): the step this plan was made for; its arguments as arrays"])
    lines = ["## Use this plan", "",
             ("The plan is saved as `plan.json` beside this report. Run the step with it (no "
              "search; shardplan checks that the step, its input shapes and the mesh are the "
              "ones it was planned for):"), "", "```python", "import jax", "", "import shardplan",
             "", *binds, *where,
             'plan = shardplan.load_plan("plan.json")',
             f"mesh = jax.make_mesh({tuple(sizes)}, {tuple(names)})",
             f"step = shardplan.auto(train_step, mesh=mesh, plan=plan{donate})",
             f"{result} = step({given})", "```", "",
             "`shardplan show plan.json` prints its summary.", ""]
    return lines
