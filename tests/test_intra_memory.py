"""The memory rows (every point where the live set can peak, reshard copies, rows added
lazily), min_memory, the deadline's plumbing and the errors, against brute force."""

import dataclasses
import re
import time

import numpy as np
import pytest

from shardplan.intra.settings import SolverSettings
from shardplan.intra.solve import (
    brute_force,
    cpsat,
    ilp,
    least_memory,
    mip,
    rows,
    types,
)
from shardplan.intra.solve.types import (
    Copy,
    InfeasibleMemory,
    SearchTimeout,
    SolverInput,
)
from shardplan.units import Deadline, fmt_bytes, parse_bytes

# Solves limited by their work, not the wall clock: the verdicts hold at any load.
WORK = SolverSettings(time_limit=10, deterministic=True)


def memory_problem(seed, n=6, k=3, rows=12, copies=4):
    """Random costs and edges, more rows than the ILP starts with, and copies on edges."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(2, k + 1, size=n)
    costs = tuple(rng.uniform(0, 1, size=s) for s in sizes)
    edges = [(int(a), b, rng.uniform(0, 2, size=(sizes[a], sizes[b])))
             for b in range(1, n) for a in rng.choice(b, size=min(b, 2), replace=False)]
    cps = []
    for _ in range(copies):
        a, b = sorted(rng.choice(n, size=2, replace=False))
        ka = rng.integers(0, 3, size=sizes[a])
        kb = rng.integers(0, 3, size=sizes[b])
        per_key = rng.integers(1, 6, size=3).astype(float)
        cps.append(Copy(int(a), ka, np.zeros(sizes[a]), int(b), kb, per_key[kb]))
    mem_rows = tuple(tuple((int(i), rng.integers(1, 10, size=sizes[i]).astype(float))
                           for i in rng.choice(n, size=3, replace=False)) for _ in range(rows))
    row_copies = tuple(tuple(sorted(int(j) for j in rng.choice(copies, size=2, replace=False)))
                       for _ in range(rows))
    base = ((0, rng.integers(1, 4, size=sizes[0]).astype(float)),)
    return SolverInput(costs, tuple(edges), mem_rows, float(rng.uniform(10, 30)),
                       solver=WORK, memory_base=base, copies=tuple(cps),
                       row_copies=row_copies)


@pytest.mark.parametrize("seed", range(12))
def test_lazy_rows_and_copies_match_brute_force(seed):
    inp = memory_problem(seed)
    assert len(inp.memory_rows) > rows.PER_ROUND  # the rows are added lazily
    try:
        ref = brute_force.brute_force(inp)
    except InfeasibleMemory as e:
        with pytest.raises(InfeasibleMemory) as got:
            ilp.solve(inp)
        assert got.value.exact
        assert got.value.min_bytes == pytest.approx(e.min_bytes)
        return
    sol = ilp.solve(inp)
    assert sol.optimal
    assert sol.objective == pytest.approx(ref.objective, rel=1e-5, abs=1e-6)
    assert types.evaluate(inp, sol.choice)[1] <= inp.memory_budget
    assert sol.peak_memory == pytest.approx(types.evaluate(inp, sol.choice)[1])


@pytest.mark.parametrize("seed", range(6))
def test_min_memory_matches_brute_force(seed):
    inp = memory_problem(seed)
    value, exact = least_memory.min_memory_bound(inp)
    assert exact
    assert value == pytest.approx(brute_force.min_peak(inp))


def test_a_copy_counts_only_when_the_layouts_differ():
    c = Copy(0, np.array([0, 1]), np.zeros(2), 1, np.array([1, 2]), np.array([4.0, 8.0]))
    assert c.size(1, 0) == 0.0  # both in layout 1
    assert c.size(0, 0) == 4.0 and c.size(1, 1) == 8.0


def test_a_copy_that_grows_a_buffer_is_never_below_nothing():
    """A later reader's larger layout held from the first reader on adds what it has over the
    first reader's copy (bytes_a < 0), and nothing where it is smaller."""
    c = Copy(0, np.array([0, 1]), np.array([-8.0, -2.0]), 1, np.array([1, 2]),
             np.array([4.0, 8.0]))
    assert c.size(0, 0) == 0.0  # 4 bytes where 8 are held already
    assert c.size(0, 1) == 0.0 and c.size(1, 1) == 6.0 and c.size(1, 0) == 0.0


@pytest.mark.parametrize("seed", range(3))
def test_the_least_memory_found_is_a_plan_and_bounds_the_least(seed):
    inp = memory_problem(seed)
    value, exact, found = least_memory.least(inp)
    assert exact and found == pytest.approx(value)
    e = InfeasibleMemory(1.0, 10.0, exact=False, found_bytes=12.0)
    assert e.found_bytes == 12.0 and "a plan that needs 12 B was found" in str(e), str(e)
    assert InfeasibleMemory(1.0, 10.0).found_bytes == 10.0


def test_an_expired_deadline_returns_a_fallback_that_fits_at_once(monkeypatch):
    """At once: no solver is run (the verdict holds at any load)."""

    def no_solver(*a, **k):
        raise AssertionError("a solver was run after the deadline")

    monkeypatch.setattr(mip, "solve", no_solver)
    monkeypatch.setattr(cpsat, "build_model", no_solver)
    inp = memory_problem(1, n=30, rows=20)
    inp = SolverInput(inp.node_costs, inp.edges, inp.memory_rows, 1e9,
                      solver=SolverSettings(time_limit=60),
                      memory_base=inp.memory_base, copies=inp.copies,
                      row_copies=inp.row_copies, deadline=Deadline(0.0))
    sol = ilp.solve(inp)
    assert not sol.optimal and sol.solver == "fallback"
    assert types.evaluate(inp, sol.choice)[1] <= inp.memory_budget


def test_an_expired_deadline_with_nothing_that_fits_says_time_ran_out():
    # Plans fit only when the two nodes take different choices; the cheap fallbacks take
    # each node's cheapest, the same.
    costs = (np.array([0.0, 1.0]), np.array([0.0, 1.0]))
    copy = Copy(0, np.array([0, 1]), np.zeros(2), 1, np.array([1, 0]), np.array([10.0, 10.0]))
    inp = SolverInput(costs, (), ((),), 5.0, copies=(copy,), row_copies=((0,),),
                      deadline=Deadline(0.0))
    with pytest.raises(SearchTimeout, match="time limit of 0 s ran out") as e:
        ilp.solve(inp)
    assert isinstance(e.value, RuntimeError)
    assert not isinstance(e.value, InfeasibleMemory)
    # with time, the plan that fits is found
    assert ilp.solve(dataclasses.replace(inp, deadline=None)).choice in ((0, 1), (1, 0))


def test_a_budget_below_every_nodes_smallest_is_infeasible_without_a_search(monkeypatch):
    """Every row with each node at its smallest is a lower bound of any plan's peak: a budget
    below it fits nothing, said at once (a 1-byte budget ran HiGHS's LP to the time limit on
    the MoE at test size on 2x4, which ended in SearchTimeout, not InfeasibleMemory)."""

    def no_mip(*a, **k):
        raise AssertionError("the MIP was run")

    monkeypatch.setattr(mip, "solve", no_mip)
    inp = dataclasses.replace(memory_problem(4), memory_budget=1.0,
                              solver=SolverSettings(time_limit=5.0),
                              deadline=Deadline(5.0))
    with pytest.raises(InfeasibleMemory) as e:
        ilp.solve(inp)
    assert e.value.min_bytes > 1.0
    if e.value.exact:
        assert e.value.min_bytes == pytest.approx(brute_force.min_peak(inp))


def test_cp_sat_gets_only_what_remains():
    inp = memory_problem(3)
    inp = dataclasses.replace(inp, solver=SolverSettings(time_limit=30.0),
                              deadline=Deadline(1.5))
    p = cpsat.solver_for(inp).parameters
    assert p.max_time_in_seconds <= 1.5 * 1.2  # the limit and its grace, no more
    assert p.max_deterministic_time == 30.0  # the same plan when the limit is generous
    # limited by its work alone: no wall clock, the same plan at any load
    p = cpsat.solver_for(dataclasses.replace(inp, solver=WORK, deadline=None)).parameters
    assert p.max_deterministic_time == 10.0 and p.max_time_in_seconds == float("inf")


def test_deadline_stops_new_stages_at_the_limit_and_solves_at_its_grace():
    d = Deadline(10.0, start=time.monotonic() - 10.5)
    assert d.expired()
    assert 0 < d.remaining() <= 1.5
    assert Deadline(0.0).remaining() == 0.0


def test_infeasible_message_formats_small_budgets():
    e = InfeasibleMemory(100.0, 3000.0)
    assert "100 B" in str(e) and "2.93 KiB" in str(e) and "0.000 GiB" not in str(e)
    e = InfeasibleMemory(100.0, 50.0, exact=False)
    assert "more than the budget" in str(e)
    assert fmt_bytes(1536) == "1.50 KiB"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1, 0, "1e999GiB", "-2MiB"])
def test_nonsense_budgets_are_refused(bad):
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes(bad)


def test_points_are_the_maximal_live_sets():
    """Every position's live set is contained in one of the points'."""
    from shardplan.intra.memory.model import MemoryModel

    rng = np.random.default_rng(0)

    class Fake(MemoryModel):
        def __init__(self, intervals):
            from shardplan.intra.memory.buffers import Buffer

            self.n = 20
            self.buffers = [Buffer(0, np.ones(1), a, b) for a, b in intervals]
            self.copies = []

    for _ in range(20):
        intervals = [tuple(sorted(rng.integers(0, 20, size=2))) for _ in range(12)]
        model = Fake(intervals)
        points = [set(b) for b, _ in model.points()]
        for t in range(20):
            live = {i for i, (a, b) in enumerate(intervals) if a <= t <= b}
            assert any(live <= p for p in points)
        assert len({frozenset(p) for p in points}) == len(points)


def test_a_dropout_mask_is_fused_into_its_readers_and_keeps_the_bits():
    """XLA fuses a cheap compare into every reader: the mask is never written, the generator's
    bits stay live until its last reader (measured on the zoo's dropout: memory_model.py)."""
    import jax
    import jax.numpy as jnp

    from shardplan.intra.memory import model as memory_model
    from shardplan.ir.lift import LiftOptions, lift
    from shardplan.ir.trace import trace

    def f(x, key):
        mask = jax.random.bits(key, x.shape) < jnp.uint32(2**31)
        y = jnp.where(mask, x, 0.0) @ x
        return jnp.sum(jnp.where(mask, jnp.tanh(y), 1.0))

    args = (jnp.ones((16, 16)), jax.random.key(0))
    t = trace(f, args, (), (0,))
    g = lift(t.closed_jaxpr, t.arg_info, LiftOptions())
    readers = {}
    for node in g.nodes:
        for v in set(node.inputs):
            readers.setdefault(v, []).append(node.id)
    pos = memory_model.schedule(g)
    virtual, last = memory_model.lifetimes(g, pos, readers, set(g.outputs))
    bits = next(n.outputs[0] for n in g.nodes if n.primitive == "random_bits")
    mask = next(n.outputs[0] for n in g.nodes if n.primitive == "lt")
    assert mask in virtual and bits not in virtual
    assert last[bits] == max(pos[r] for r in readers[mask]) > min(pos[r] for r in readers[mask])


def test_peak_sweep_equals_the_rows_at_every_point():
    """The ILP's rows sum what is live at each point: on a GPT step and random choices, they
    agree exactly with a sweep over the same buffers' intervals, and MemoryModel.peak (which
    also knows how long a dropout mask's bits live once every layout is chosen: masks.py) is
    never above them."""
    from shardplan.cost.hardware import get_profile
    from shardplan.cost.model import AlphaBetaCost
    from shardplan.intra.options import intra_options
    from shardplan.intra.problem import Problem
    from shardplan.ir.lift import LiftOptions, lift
    from shardplan.ir.trace import trace
    from shardplan.models import get_model
    from shardplan.options import DEFAULTS
    from shardplan.strategies.spec import MeshShape

    step = get_model("gpt", abstract=True)
    traced = trace(step.fn, tuple(step.args), step.state_argnums, step.batch_argnums)
    graph = lift(traced.closed_jaxpr, traced.arg_info, LiftOptions())
    mesh = MeshShape(("data", "model"), (2, 4))
    problem = Problem(graph, mesh, AlphaBetaCost(mesh, get_profile("cpu"), None),
                      intra_options(DEFAULTS))
    model = problem.memory()
    rng = np.random.default_rng(0)
    for _ in range(5):
        choice = {r: int(rng.integers(len(problem.strategies[r]))) for r in problem.roots}
        at_points = 0.0
        for bufs, cps in model.points():
            total = sum(float(model.buffers[i].nbytes[choice[model.buffers[i].root]])
                        for i in bufs)
            for j in cps:
                c = model.copies[j]
                if c.key_a[choice[c.a]] != c.key_b[choice[c.b]]:
                    # a copy that grows a buffer (bytes_a < 0) is never below nothing
                    total += max(0.0, float(c.bytes_a[choice[c.a]] + c.bytes_b[choice[c.b]]))
            at_points = max(at_points, total)
        assert at_points > 0
        items = [(b.start, b.end, float(b.nbytes[choice[b.root]])) for b in model.buffers]
        items += [(c.start, c.end, max(0.0, float(c.bytes_a[choice[c.a]]
                                                  + c.bytes_b[choice[c.b]])))
                  for c in model.copies if c.key_a[choice[c.a]] != c.key_b[choice[c.b]]]
        swept = max(sum(b for a, e, b in items if a <= t <= e)
                    for t in range(max(e for _, e, _ in items) + 1))
        assert swept == pytest.approx(at_points, rel=1e-12)  # margin: floats
        assert model.peak(choice) <= at_points * (1 + 1e-12)


def test_what_xla_simplifies_away_is_never_written():
    """A gather's gradient is a scatter-add into zeros: when an add alone reads the scatter,
    XLA scatters into the add's other operand in place and writes neither; else the zeros are
    the scatter's operand, written (here the log-softmax's backward reads the scatter with a
    product: XLA writes the [4, 32] zeros as a fusion of their own). A transpose that only
    dots read is folded into them (measured on the live ranges of llama and the MoE at test
    size: memory_model.py)."""
    import jax
    import jax.numpy as jnp

    from shardplan.intra.memory import liveness
    from shardplan.ir.lift import LiftOptions, lift
    from shardplan.ir.trace import trace

    def f(w, x, labels):
        logits = x @ w.T
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)
        return -jnp.mean(picked)

    def tied(w, x, labels):  # the table's gradient: the lookup's scatter plus the dot's
        return jnp.sum(w[labels] ** 2) + jnp.sum(x @ w.T)

    def lifted(fn):
        t = trace(jax.grad(fn), args, (0,), (1, 2))
        g = lift(t.closed_jaxpr, t.arg_info, LiftOptions())
        readers = {}
        for node in g.nodes:
            for v in set(node.inputs):
                readers.setdefault(v, []).append(node.id)
        virtual = liveness.unwritten(g, readers, {v: [j] for j, v in enumerate(g.outputs)})
        producer = {v: n for n in g.nodes for v in n.outputs}
        scatter = next(n for n in g.nodes if n.primitive == "scatter-add")
        zeros = producer[scatter.inputs[0]]
        assert zeros.primitive == "broadcast_in_dim"
        folded = all(g.nodes[r].primitive in ("add", "add_any")
                     for r in readers[scatter.outputs[0]])
        return g, readers, virtual, scatter, zeros, folded

    args = (jnp.ones((32, 8)), jnp.ones((4, 8)), jnp.zeros((4,), jnp.int32))
    _, _, virtual, scatter, zeros, folded = lifted(tied)
    assert folded and {zeros.outputs[0], scatter.outputs[0]} <= virtual
    compiled = jax.jit(jax.grad(tied)).lower(*args).compile().as_text()
    assert not re.search(r"= f32\[32,8\]\S* fusion\(%constant", compiled)  # into the dot's
    g, readers, virtual, scatter, zeros, folded = lifted(f)
    assert not folded
    assert zeros.outputs[0] not in virtual and scatter.outputs[0] not in virtual
    compiled = jax.jit(jax.grad(f)).lower(*args).compile().as_text()
    assert re.search(r"= f32\[4,32\]\S* fusion\(%constant", compiled)  # the zeros, written
    transposes = [n for n in g.nodes if n.primitive == "transpose" and n.outputs[0] in readers
                  and all(g.nodes[r].primitive == "dot_general" for r in readers[n.outputs[0]])]
    assert transposes and all(n.outputs[0] in virtual for n in transposes)


def test_memory_rows_equal_the_live_sets_summed_at_each_point():
    """ilp_rows.solver_terms (array operations) against its definition, point by point:
    random buffers and copies over a few roots, some tied to one representative."""
    from shardplan.intra.memory import ilp_rows
    from shardplan.intra.memory.buffers import Buffer, LiveCopy

    rng = np.random.default_rng(1)
    for _ in range(10):
        index = {r: r % 3 for r in range(5)}  # roots 0..4 over representatives 0..2
        width = 3

        def span():
            a, b = sorted(int(x) for x in rng.integers(0, 30, size=2))
            return a, b

        buffers = [Buffer(int(rng.integers(5)), rng.integers(1, 100, width).astype(float), *span())
                   for _ in range(25)]
        copies = [LiveCopy(int(rng.integers(5)), rng.integers(0, 2, width),
                       rng.integers(-5, 50, width).astype(float), int(rng.integers(5)),
                       rng.integers(0, 2, width), rng.integers(1, 50, width).astype(float),
                       *span()) for _ in range(15)]
        base, rows, shared, row_copies = ilp_rows.solver_terms(buffers, copies, index)
        choice = [int(rng.integers(width)) for _ in range(3)]
        # the peak the rows give under one choice per representative
        sizes = [c.size(choice[c.a], choice[c.b]) for c in shared]
        fixed = sum(float(m[choice[r]]) for r, m in base)
        from_rows = max(fixed + sum(float(m[choice[r]]) for r, m in row)
                        + sum(sizes[j] for j in js) for row, js in zip(rows, row_copies))
        # the definition: everything live at each moment
        times = sorted({b.end for b in buffers} | {c.end for c in copies})
        direct = 0.0
        for t in times:
            total = sum(float(b.nbytes[choice[index[b.root]]]) for b in buffers
                        if b.start <= t <= b.end)
            for c in copies:
                ka, kb = choice[index[c.a]], choice[index[c.b]]
                if c.start <= t <= c.end and c.key_a[ka] != c.key_b[kb]:
                    total += max(0.0, float(c.bytes_a[ka] + c.bytes_b[kb]))
            direct = max(direct, total)
        assert from_rows == pytest.approx(direct, rel=1e-12)


def _dropout_problem():
    """A dropout layer's gradient step on 2x4: the mask is read in the forward and the backward
    pass; the ILP may lay it out otherwise than the generator's bits."""
    import jax
    import jax.numpy as jnp

    from shardplan.cost.hardware import get_profile
    from shardplan.cost.model import AlphaBetaCost
    from shardplan.intra.options import intra_options
    from shardplan.intra.problem import Problem
    from shardplan.ir.lift import LiftOptions, lift
    from shardplan.ir.trace import trace
    from shardplan.options import DEFAULTS
    from shardplan.strategies.spec import MeshShape

    def loss(w, x, key):
        h = x @ w
        keep = jax.random.bernoulli(key, 0.9, h.shape)
        return jnp.sum(jnp.tanh(jnp.where(keep, h / 0.9, 0.0)) @ w.T)

    def step(w, x, key):
        return w - 0.1 * jax.grad(loss)(w, x, key)

    args = (jnp.ones((64, 64)), jnp.ones((32, 64)), jax.random.key(0))
    t = trace(step, args, (0,), (1,))
    g = lift(t.closed_jaxpr, t.arg_info, LiftOptions())
    mesh = MeshShape(("data", "model"), (2, 4))
    return Problem(g, mesh, AlphaBetaCost(mesh, get_profile("cpu"), None),
                   intra_options(DEFAULTS))


def test_a_resharded_dropout_mask_is_held_as_booleans_and_the_bits_die():
    """Where every read of a dropout mask is in another layout than the generator's, XLA fuses
    the compare into the reshard and holds the mask's booleans, not the generator's two words
    (a GPT on 2x4: every mask held as `pred`, the words freed at once; masks.py): the plan's
    peak counts the bits to the first read and one byte per element to each read; the ILP's
    rows never count less."""
    problem = _dropout_problem()
    model = problem.memory()
    (mask,) = model.masks
    bits = model.buffers[mask.buffer]
    assert "random_bits" in bits.what and len(mask.reads) >= 2
    assert bits.end > mask.first  # the rows hold the bits to the backward's read
    rng = np.random.default_rng(0)
    resharded = 0
    for _ in range(300):
        choice = {r: int(rng.integers(len(problem.strategies[r]))) for r in problem.roots}
        live = model.live(choice)
        moved = [rd for rd in mask.reads
                 if rd.key_src[choice[rd.src]] != rd.key_dst[choice[rd.dst]]]
        _, end, nbytes, _ = live[mask.buffer]
        if len(moved) == len(mask.reads):
            resharded += 1
            assert end == mask.first  # the words die at the reshard
            copies = [x for x in live if x[3].endswith("mask resharded")]
            assert copies and all(a == mask.first for a, _, _, _ in copies)
            assert max(b for _, b, _, _ in copies) == max(rd.end for rd in mask.reads)
            for _, _, size, _ in copies:  # booleans: a quarter of one word, an eighth of both
                assert size <= nbytes / 8 * problem.graph.values[mask.reads[0].value].size
        elif not moved:
            assert end == bits.end and not any(x[3].endswith("mask resharded") for x in live)
        rows = 0.0
        for bufs, cps in model.points():
            total = sum(float(model.buffers[i].nbytes[choice[model.buffers[i].root]])
                        for i in bufs)
            total += sum(max(0.0, float(c.bytes_a[choice[c.a]] + c.bytes_b[choice[c.b]]))
                         for c in (model.copies[j] for j in cps)
                         if c.key_a[choice[c.a]] != c.key_b[choice[c.b]])
            rows = max(rows, total)
        assert model.peak(choice) <= rows * (1 + 1e-12)
    assert resharded


def _problem_2x4(step, args, state=(0,), batch=(1,)):
    from shardplan.cost.hardware import get_profile
    from shardplan.cost.model import AlphaBetaCost
    from shardplan.intra.options import intra_options
    from shardplan.intra.problem import Problem
    from shardplan.ir.lift import LiftOptions, lift
    from shardplan.ir.trace import trace
    from shardplan.options import DEFAULTS
    from shardplan.strategies.spec import MeshShape

    t = trace(step, args, state, batch)
    g = lift(t.closed_jaxpr, t.arg_info, LiftOptions())
    mesh = MeshShape(("data", "model"), (2, 4))
    return Problem(g, mesh, AlphaBetaCost(mesh, get_profile("cpu"), None),
                   intra_options(DEFAULTS))


def test_an_activation_read_only_through_one_copy_dies_at_its_first_reader():
    """A value its forward and backward dots both read in one other layout is resharded once,
    at the forward dot, and XLA frees it there (the MoE on 2x4: an expert dot's result held
    only as its copy; originals.py); read as laid out, it lives to that read. The rows keep
    it to its last reader."""
    import jax
    import jax.numpy as jnp

    def loss(ws, x):
        return jnp.sum(jnp.tanh((x @ ws[0]) @ ws[1]))

    def step(ws, x):
        return [w - 0.1 * d for w, d in zip(ws, jax.grad(loss)(ws, x))]

    problem = _problem_2x4(step, ([jnp.ones((64, 64))] * 2, jnp.ones((32, 64))))
    model, g = problem.memory(), problem.graph
    h = next(n.outputs[0] for n in g.nodes if n.primitive == "dot_general")
    (o,) = [o for o in model.originals if o.buffer == model.owned[h]]
    dots = sorted(model.pos[n.id] for n in g.nodes if n.primitive == "dot_general"
                  and h in n.inputs)
    assert len(dots) == 2 and model.buffers[o.buffer].end >= dots[1]
    rng = np.random.default_rng(0)
    shared = direct = 0
    for _ in range(400):
        choice = {r: int(rng.integers(len(problem.strategies[r]))) for r in problem.roots}
        end = model.live(choice)[o.buffer][1]
        assert o.floor <= end <= model.buffers[o.buffer].end
        src = problem.out_spec(problem.producer[h][0], 0, choice[problem.groups.root[
            problem.producer[h][0]]])
        reads = [problem.in_spec(problem.num_inputs + n.id, n.inputs.index(h),
                                 choice[problem.groups.root[problem.num_inputs + n.id]])
                 for n in g.nodes if n.primitive == "dot_general" and h in n.inputs]
        if reads[0] == reads[1] != src:
            shared += 1
            assert end < dots[1]  # no second reshard from it: the backward reads the copy
        if reads[1] == src:
            direct += 1
            assert end >= dots[1]
    assert shared and direct


def test_a_gradient_feeding_a_reduced_gradient_is_not_held_for_the_combined_all_reduce():
    """XLA combines only reductions independent of each other: an input gradient that the
    embedding's scattered gradient sums is reduced where it is made when the scatter is
    reduced too, and held for the combined all-reduce only when it is not (llama on 2x4:
    gradient_holds.py)."""
    import jax
    import jax.numpy as jnp

    def loss(params, ids):
        x = jnp.take(params["wte"], ids, axis=0)
        return jnp.sum(jnp.tanh(x @ params["w"]))

    def step(params, ids):
        return jax.tree.map(lambda p, d: p - 0.1 * d, params, jax.grad(loss)(params, ids))

    params = {"wte": jnp.ones((256, 64)), "w": jnp.ones((64, 64))}
    problem = _problem_2x4(step, (params, jnp.zeros((32,), jnp.int32)))
    model, g = problem.memory(), problem.graph
    dx = next(n for n in g.nodes if n.primitive == "dot_general" and g.values[n.outputs[0]]
              .shape == (32, 64) and n.name.startswith("transpose"))
    scatter = next(n for n in g.nodes if n.primitive == "scatter-add")
    # the input gradient's hold is a pair term with the scatter's reduction, not a buffer
    assert not [b for b in model.buffers if b.what.startswith(f"dot_general {dx.name}")
                and ("held for" in b.what or "all-reduced" in b.what)
                and b.root == problem.groups.root[problem.num_inputs + dx.id]]
    held = [c for c in model.copies if "all-reduced" in c.what or "held for" in c.what]
    assert held
    for c in held:
        assert c.a == problem.groups.root[problem.num_inputs + dx.id]
        assert c.b == problem.groups.root[problem.num_inputs + scatter.id]
        for k in range(len(c.key_a)):
            for m in range(len(c.key_b)):
                reduced, scattered = c.key_a[k] == 1, c.key_b[m] == 1
                counted = c.key_a[k] != c.key_b[m] and c.bytes_a[k] + c.bytes_b[m] > 0
                assert counted == (reduced and not scattered and c.bytes_a[k] > 0)
        assert (c.key_a == 1).any() and (c.key_b == 1).any() and (c.key_b == 2).any()
