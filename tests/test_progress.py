"""Progress of a planning job (shardplan.progress, shardplan.progress_display): the phases in
order and the solver's bound and gap reach a reporter, the plan is the same with and without
one, and nothing is drawn where the stream is not a terminal or the CLI is quiet."""

import io

import jax
import jax.numpy as jnp
import pytest
from rich.console import Console

import shardplan
from shardplan import progress, progress_display
from shardplan.cli import main


class Recording:
    """A reporter that keeps what it is told: ("started", phase, done, total),
    ("ended", phase, failed) and ("solver", SolverUpdate)."""

    def __init__(self):
        self.events = []

    def started(self, phase, done=None, total=None):
        self.events.append(("started", phase, done, total))

    def ended(self, phase, failed=False):
        self.events.append(("ended", phase, failed))

    def solver(self, update):
        self.events.append(("solver", update))

    def phases(self):
        return [e[1] for e in self.events if e[0] == "started"]


def _mlp():
    def step(params, x, y):
        def loss(p):
            h = jax.nn.relu(x @ p["w1"])
            return jnp.mean((h @ p["w2"] - y) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    params = {"w1": jax.ShapeDtypeStruct((64, 256), jnp.float32),
              "w2": jax.ShapeDtypeStruct((256, 64), jnp.float32)}
    return step, (params, jax.ShapeDtypeStruct((32, 64), jnp.float32),
                  jax.ShapeDtypeStruct((32, 64), jnp.float32))


def _search(budget=None, **kw):
    step, args = _mlp()
    return shardplan.search(step, *args, cluster="cpu", mesh_shape=(2, 4),
                            state_argnums=(0,), batch_argnums=(1, 2), deterministic=True,
                            memory_budget=budget, **kw)


def test_a_reporter_sees_the_phases_in_order_and_the_solvers_bound():
    rec = Recording()
    free = _search()
    # a budget a little above the least any plan needs: the least memory is proven too
    budget = int(1.02 * free.estimate.peak_bytes)
    _search(budget, progress=rec)
    phases = rec.phases()
    order = ["tracing", "lifting", "strategies and costs", "the ILP", "presolve"]
    assert [p for p in phases if p in order][:len(order)] == order, phases
    assert any(p.startswith("MIP (HiGHS)") for p in phases), phases
    # every phase that started ended, innermost first, none failed
    stack = []
    for e in rec.events:
        if e[0] == "started":
            stack.append(e[1])
        elif e[0] == "ended":
            assert stack.pop() == e[1] and not e[2], e
    assert not stack
    updates = [e[1] for e in rec.events if e[0] == "solver"]
    assert any(u.bound is not None and u.gap is not None for u in updates), updates
    for u in updates:
        if u.gap is not None:
            assert u.gap >= 0.0
            assert u.unit == "B" or u.bound <= u.incumbent * (1 + 1e-6), u


def test_the_plan_is_the_same_with_and_without_a_reporter():
    free = _search()
    budget = int(1.02 * free.estimate.peak_bytes)
    quiet, told = _search(budget), _search(budget, progress=Recording())
    assert told.input_specs == quiet.input_specs
    assert told.output_specs == quiet.output_specs
    assert told.constraints == quiet.constraints
    assert told.estimate == quiet.estimate


def test_a_stream_that_is_not_a_terminal_gets_no_progress():
    stream = io.StringIO()
    console = Console(file=stream, force_terminal=False)
    reporter = progress_display.for_console(console)
    assert reporter is progress.SILENT
    _search(progress=reporter)
    assert stream.getvalue() == ""
    assert progress_display.for_console(Console(file=io.StringIO(), force_terminal=True,
                                                quiet=True)) is progress.SILENT


def test_a_terminal_is_drawn_on_while_phases_run_and_left_clean():
    stream = io.StringIO()
    console = Console(file=stream, force_terminal=True, width=100)
    live = progress_display.for_console(console)
    assert isinstance(live, progress_display.LiveProgress)
    with progress.phase(live, "planning", 1, 2):
        with progress.phase(live, "the ILP"):
            live.solver(progress.SolverUpdate("HiGHS", "MIP", 2e-3, 1.9e-3))
            console.print(live.__rich__())
        # the solver's line goes with the phase it came in
        assert "HiGHS" not in "".join(line.plain for line in live.__rich__().renderables)
    text = stream.getvalue()
    assert "planning (1 of 2)" in text and "the ILP" in text
    assert "HiGHS MIP: incumbent 2.000 ms, bound 1.900 ms, gap 5.00%" in text
    assert live.__rich__().plain == ""  # nothing left open


def test_describe_gives_bytes_for_memory():
    line = progress_display.describe(progress.SolverUpdate("CP-SAT", "least memory", 2**20,
                                                           2**19, "B"))
    assert line.startswith("CP-SAT least memory: incumbent 1")
    assert "gap 50.00%" in line


def _config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {name: mlp, size: tiny, batch_size: 64, overrides: {width: 64}}\n"
                    "cluster: {hardware: a100-80gb, mesh: {shape: [2, 4]}}\n"
                    "search: {time_limit: 20}\n"
                    "output: {compare: false}\n")
    return str(path)


@pytest.mark.parametrize("quiet", [True, False])
def test_the_cli_shows_progress_unless_quiet(tmp_path, capsys, quiet):
    args = ["search", _config(tmp_path), "--out", str(tmp_path / "out")]
    assert main(args + (["--quiet"] if quiet else [])) == 0
    err = capsys.readouterr().err
    if quiet:
        assert err == ""
    else:  # not a terminal: a line per phase, nothing drawn live
        assert "planning " in err and "\x1b[" not in err
