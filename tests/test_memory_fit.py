"""A plan said to fit its memory budget fits once XLA compiles it, and its estimate is within
TOLERANCE of the compiled peak (memory_analysis: argument + output + temp - alias), on cheap
cases at test size; benchmarks/memory_check.py runs the zoo at three budgets on 8 and 2x4
devices. A bf16 step compiled on CPU is counted as the target would hold it (XLA:CPU computes
bf16 through f32 buffers)."""

import dataclasses
import time
import warnings

import jax
import pytest

import shardplan
from shardplan.analysis import hlo, targets
from shardplan.cost.hardware import get_profile
from shardplan.intra.memory import liveness
from shardplan.ir.lift import lift
from shardplan.ir.trace import trace
from shardplan.models import get_model
from shardplan.options import DEFAULTS
from shardplan.planning import compiled as compiled_mod
from shardplan.planning import driver, select
from shardplan.planning.expert_plans import expert_plans
from shardplan.planning.intra_op import plan_step
from shardplan.planning.job import Job
from shardplan.strategies.spec import MeshShape

# The estimate is to be within this of the compiled peak (issue 11).
TOLERANCE = 0.10

# name, config overrides, where the budget sits as a share of data parallel's compiled peak
# (cheap cases: the zoo at three budgets is benchmarks/memory_check.py's).
CASES = {
    "mlp": ({}, 0.5),
    "gpt": ({}, 0.6),
}


def _data_parallel_peak(m, mesh) -> int:
    traced = trace(m.fn, m.args, m.state_argnums, m.batch_argnums)
    job = Job.make(traced, MeshShape.of(mesh), get_profile("cpu"),
                   DEFAULTS.replace(time_limit=10.0, deterministic=True), device_mesh=mesh)
    plan, graph, _ = plan_step(traced, job.mesh, job.hw, job.options, device_mesh=mesh)
    dp = expert_plans(job, plan, complete=False)["data_parallel"]
    lowered = compiled_mod.lower_plan(graph, traced, dp, mesh, m.state_argnums)
    return hlo.analyze(compiled_mod.compile_for_analysis(lowered)).peak_bytes


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_plan_said_to_fit_fits_and_its_estimate_is_within_tolerance(name, mesh2x4):
    overrides, share = CASES[name]
    m = get_model(name, "tiny", abstract=True, **overrides)
    budget = int(share * _data_parallel_peak(m, mesh2x4))
    step = shardplan.auto(m.fn, mesh=mesh2x4, hardware="cpu", memory_budget=budget,
                          donate_argnums=m.state_argnums, state_argnums=m.state_argnums,
                          batch_argnums=m.batch_argnums, time_limit=60, deterministic=True)
    # (a generous limit: the check gets what the search leaves of it, and on a loaded machine
    # a 20 s search used it all and the check was skipped)
    plan = step.plan(*m.args)
    assert plan.estimate.peak_bytes <= budget
    assert any("margin of 10%" in n for n in plan.notes), plan.notes
    assert any(n.startswith("memory checked once compiled") for n in plan.notes), plan.notes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # donating abstract arguments warns
        peak = hlo.analyze(compiled_mod.compile_for_analysis(step.lower(*m.args))).peak_bytes
    assert peak <= budget, (peak, budget, plan.estimate.peak_bytes)
    assert abs(peak / plan.estimate.peak_bytes - 1) <= TOLERANCE, (peak, plan.estimate.peak_bytes)
    # the memory model's own estimate, before the check compiled it
    assert abs(peak / plan.model_estimate.peak_bytes - 1) <= TOLERANCE, (
        peak, plan.model_estimate.peak_bytes)


def _over_budget_at_first(monkeypatch, times, factor):
    """compiled_mod.measure reporting the first `times` programs compiled at `factor` x their peak."""
    real, calls = compiled_mod.measure, []

    def fake(*args, **kwargs):
        got = real(*args, **kwargs)
        calls.append(got.name)
        if len(calls) > times:
            return got
        return dataclasses.replace(got, priced=dataclasses.replace(
            got.priced, peak_bytes=factor * got.priced.peak_bytes))

    monkeypatch.setattr(compiled_mod, "measure", fake)
    return calls


@pytest.mark.parametrize("times,factor", [(1, 3), (3, 10)])
def test_a_plan_compiled_over_the_budget_is_planned_again_or_not_said_to_fit(
        times, factor, mesh2x4, monkeypatch):
    """Under a budget on devices the plan is compiled: over the budget, the ILP plans again
    under a scaled budget (shardplan.planning.select); when no re-plan compiles within it either (or the
    time limit leaves none: the least memory's proof can take what remains), the plan
    returned says it does not fit (its estimate is the compiled peak) and a warning says so."""
    m = get_model("mlp", "tiny", abstract=True)
    traced = trace(m.fn, m.args, m.state_argnums, m.batch_argnums)
    options = DEFAULTS.replace(memory_budget=300 * 2**10, time_limit=10.0,
                               state_argnums=m.state_argnums, batch_argnums=m.batch_argnums)
    calls = _over_budget_at_first(monkeypatch, times, factor)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = driver.judged(Job.make(traced, MeshShape.of(mesh2x4), get_profile("cpu"),
                                      options, device_mesh=mesh2x4,
                                      donate_argnums=m.state_argnums))
    note = next(n for n in plan.notes if n.startswith("memory checked once compiled"))
    assert calls[0] == "searched", calls
    assert plan.model_estimate is not None
    said = [str(w.message) for w in caught if "no plan compiles within" in str(w.message)]
    if times == 1:
        assert calls[1].startswith("searched-1"), calls
        assert plan.fits() and "kept searched-1" in note and not said, (note, said)
    else:
        assert not plan.fits() and "no plan compiled within" in note and said, (note, said)


def _graph(name, **overrides):
    m = get_model(name, "tiny", abstract=True, **overrides)
    traced = trace(m.fn, m.args, m.state_argnums, m.batch_argnums)
    return m, lift(traced.closed_jaxpr, traced.arg_info)


def _replicated_peak(m, mesh) -> hlo.ProgramStats:
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lowered = jax.jit(m.fn, in_shardings=rep, out_shardings=rep).lower(*m.args)
    return hlo.analyze(compiled_mod.compile_for_analysis(lowered))


def test_xla_cpu_computes_bf16_in_f32_and_the_widening_says_how_much_the_target_keeps():
    """The fact the widening rests on, measured where the XLA:CPU in use widens (jax 0.10's;
    jax 0.12's keeps bf16, tests/test_model_agrees.py): the bf16 MLP's compiled peak on CPU is
    no less than the f32 MLP's (params f32 in both; a GPT's is equal to the byte); the model's
    share of the temporaries a bf16 device keeps is below 1 for the bf16 step and exactly 1 for
    the f32 one."""
    if not targets.xla_cpu_widens():
        pytest.skip("this XLA:CPU keeps bf16 intermediates in bf16: nothing is widened")
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    peaks = {}
    for dtype in ("float32", "bfloat16"):
        m, graph = _graph("mlp", dtype=dtype, param_dtype="float32")
        peaks[dtype] = _replicated_peak(m, mesh).peak_bytes
        w = liveness.cpu_widening(graph)
        assert (w == 1.0) if dtype == "float32" else (0.5 <= w < 1.0), (dtype, w)
    assert peaks["bfloat16"] >= peaks["float32"], peaks


def test_the_widening_probe_says_what_xla_cpu_does(mesh8):
    """targets.xla_cpu_widens (one small bf16 compile) against a whole step: the tiny GPT in
    bf16 (params f32) holds temporaries no smaller than in f32 where XLA:CPU widens bf16 (jax
    0.10.2: 2180160 against 2045504 bytes) and smaller where it keeps bf16 (jax 0.12: 1591360
    against 2043968); only a widening XLA:CPU has its temporaries scaled back for a GPU."""
    temps = {dtype: _replicated_peak(_graph("gpt", dtype=dtype, param_dtype="float32")[0],
                                     mesh8).temp_bytes
             for dtype in ("float32", "bfloat16")}
    widens = targets.xla_cpu_widens()
    assert (temps["bfloat16"] >= temps["float32"]) == widens, (temps, widens)
    assert targets.widens(mesh8, get_profile("a100-80gb")) == widens
    assert not targets.widens(mesh8, get_profile("cpu"))


def test_compiled_peaks_on_cpu_count_the_temporaries_as_the_target_holds_them(mesh2x4,
                                                                              monkeypatch):
    monkeypatch.setattr(targets, "xla_cpu_widens", lambda: True)  # jax 0.10's XLA:CPU
    stats = hlo.ProgramStats((), 0.0, 0.0, 0.0, argument_bytes=100, output_bytes=60,
                             temp_bytes=1000, alias_bytes=50, peak_bytes=1110)
    gpu = get_profile("a100-80gb")
    assert targets.widens(mesh2x4, gpu) and not targets.widens(mesh2x4, get_profile("cpu"))
    assert targets.on_target(stats, mesh2x4, gpu, 0.6).peak_bytes == 100 + 60 - 50 + 600
    assert targets.on_target(stats, mesh2x4, get_profile("cpu"), 0.6) is stats
    assert targets.on_target(stats, mesh2x4, gpu, 1.0) is stats
    monkeypatch.setattr(targets, "xla_cpu_widens", lambda: False)  # jax 0.12's
    assert targets.on_target(stats, mesh2x4, gpu, 0.6) is stats


def test_the_compiled_check_compiles_the_donation_the_step_runs_with(mesh2x4):
    """A step that donates nothing holds its state twice (arguments and results): the check
    compiles it so, and the peak it reports is the peak of the program that runs (it compiled
    the state donated, as measure=True does, and read 128 KB where the step needs 206 KB)."""
    m = get_model("mlp", "tiny", abstract=True)
    budget = int(0.9 * _data_parallel_peak(m, mesh2x4))
    step = shardplan.auto(m.fn, mesh=mesh2x4, hardware="cpu", memory_budget=budget,
                          state_argnums=m.state_argnums, batch_argnums=m.batch_argnums,
                          time_limit=60, deterministic=True)
    plan = step.plan(*m.args)
    assert any(n.startswith("memory checked once compiled") for n in plan.notes), plan.notes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peak = hlo.analyze(compiled_mod.compile_for_analysis(step.lower(*m.args))).peak_bytes
    assert plan.estimate.peak_bytes == pytest.approx(peak, rel=1e-6)


@pytest.mark.parametrize("name", ["llama", "moe", "vit"])
def test_the_memory_models_own_estimate_is_within_tolerance_of_the_compiled_peak(name, mesh8):
    """The memory model's estimate (no compiled check) of the plan it is asked about, set
    against the plan compiled. Without the zeros a gather's gradient is scattered into held
    from the step's start, the scatter into them kept beside the add XLA scatters into, and
    the transposed embedding the logits' dot folds, the model counted llama at 1/0.779 and
    the MoE at 1/0.802 of their compiled peaks; without the layer norms' broadcasts that
    YNNPACK's reductions read (liveness.ynn_broadcasts), ViT at 1/1.257."""
    m = get_model(name, "tiny", abstract=True)
    traced = trace(m.fn, m.args, m.state_argnums, m.batch_argnums)
    plan, graph, _ = plan_step(traced, MeshShape.of(mesh8), get_profile("cpu"),
                               DEFAULTS.replace(time_limit=20.0, deterministic=True),
                               device_mesh=mesh8)
    lowered = compiled_mod.lower_plan(graph, traced, plan, mesh8, m.state_argnums)
    peak = hlo.analyze(compiled_mod.compile_for_analysis(lowered)).peak_bytes
    assert abs(peak / plan.estimate.peak_bytes - 1) <= TOLERANCE, (peak, plan.estimate.peak_bytes)


def test_re_plans_and_their_compiles_end_within_the_time_limit(mesh2x4, monkeypatch):
    """Every program compiling over the budget (and each compile 2.5 s): the check re-plans
    only while a re-plan and its compile fit in what remains of the time limit, so the whole
    check ends within 1.2x of it (re-planning whatever remained, then compiling, ran 30 s
    limits to 46-73 s on 2x4)."""
    real, calls = compiled_mod.measure, []

    def slow(*args, **kwargs):
        time.sleep(2.5)
        got = real(*args, **kwargs)
        calls.append(got.name)
        return dataclasses.replace(got, priced=dataclasses.replace(
            got.priced, peak_bytes=10 * got.priced.peak_bytes))

    monkeypatch.setattr(compiled_mod, "measure", slow)
    m = get_model("mlp", "tiny", abstract=True)
    traced = trace(m.fn, m.args, m.state_argnums, m.batch_argnums)
    options = DEFAULTS.replace(memory_budget=300 * 2**10, time_limit=7.0,
                               state_argnums=m.state_argnums, batch_argnums=m.batch_argnums)
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = driver.judged(Job.make(traced, MeshShape.of(mesh2x4), get_profile("cpu"),
                                      options, device_mesh=mesh2x4,
                                      donate_argnums=m.state_argnums))
    took = time.perf_counter() - t
    assert took <= 1.2 * options.time_limit, (took, calls)
    assert calls[0] == "searched" and not plan.fits()
    assert len(calls) < 1 + select.RECALIBRATIONS, calls  # a re-plan was left out


@pytest.mark.slow  # 25 s
def test_a_kernel_read_whole_in_the_backward_is_held_whole_from_the_forward(mesh2x4,
                                                                          monkeypatch):
    """Expert plans on 2x4 (FSDP, 2-D), laid out by the ILP: a kernel its forward dot reads
    gathered on one axis (or as stored) and its backward dot reads whole. XLA gathers it whole
    at the forward dot and keeps that copy until the backward one (the compiled program
    all-gathers whole kernels); the memory model holds the larger layout from the first layer
    on (the hoisted copies add what the backward's layout has over the forward's). Without it
    a GPT's plan on 2x4 was estimated at 1/1.16 of its compiled peak (under: the unsafe side).
    Which expert's completion reads kernels so depends on the cost model (FSDP's did when this
    was written, the 2-D plan's since the loss's reduction is priced as XLA combines it), and
    on the fan-outs: planned with fanouts="layers" here, as under "reduce" (auto on two axes)
    the 2-D completion reads its kernels whole in both passes (one copy held alike: compiled
    at 0.90 of the estimate)."""
    from shardplan.intra import problem
    from shardplan.intra.memory import model as memory_model
    from shardplan.units import Deadline

    monkeypatch.setattr(problem, "fanout_mode", lambda mode, mesh: "layers")

    m = get_model("gpt", "tiny", abstract=True)
    traced = trace(m.fn, m.args, m.state_argnums, m.batch_argnums)
    models = []
    real = memory_model.MemoryModel.peak

    def peak(self, choice):
        got = real(self, choice)
        models.append((got, self, dict(choice)))
        return got

    monkeypatch.setattr(memory_model.MemoryModel, "peak", peak)
    options = DEFAULTS.replace(time_limit=20.0, deterministic=True, state_argnums=m.state_argnums,
                               batch_argnums=m.batch_argnums)
    mesh = MeshShape.of(mesh2x4)
    plan, graph, _ = plan_step(traced, mesh, get_profile("cpu"), options, device_mesh=mesh2x4)
    job = Job.make(traced, mesh, get_profile("cpu"), options, device_mesh=mesh2x4)
    kernels = {tuple(graph.values[v].shape) for v in graph.inputs if graph.values[v].ndim == 2}
    checked = []
    for name, expert in expert_plans(job, plan, deadline=Deadline(60.0)).items():
        if name not in ("fsdp", "two_d"):
            continue
        compiled = compiled_mod.compile_for_analysis(
            compiled_mod.lower_plan(graph, traced, expert, mesh2x4, m.state_argnums))
        if not any(f"f32[{a},{b}]" in line and "all-gather(" in line
                   for a, b in kernels for line in compiled.as_text().splitlines()):
            continue  # no kernel gathered whole
        _, model, choice = min(models, key=lambda t: abs(t[0] - expert.estimate.peak_bytes))
        grown = [c for c in model.copies if c.what.startswith("hoisted")
                 and c.key_a[choice[c.a]] != c.key_b[choice[c.b]]
                 and c.bytes_a[choice[c.a]] + c.bytes_b[choice[c.b]] > 0]
        assert grown, f"{name}: no kernel read in a larger layout by its backward dot"
        peak_bytes = hlo.analyze(compiled).peak_bytes
        # the safe side (FSDP: 0.82 measured; 0.71 with the gradients held for a combined
        # all-reduce that XLA does not run there: it gathers the activations whole and
        # computes each kernel gradient's shard where the plan reduce-scatters partial sums)
        assert peak_bytes <= expert.estimate.peak_bytes, (name, peak_bytes,
                                                          expert.estimate.peak_bytes)
        checked.append(name)
    assert checked, "no expert plan gathers a kernel whole"


def test_gradients_reduced_together_are_held_until_their_combined_all_reduce(mesh8):
    """Data parallel on 8 devices (the state replicated, the batch split; the ILP lays out the
    rest): XLA reduces every gradient in one combined all-reduce, after the last of them is
    made, so all are live together, and again as its results. Freeing each gradient at its
    update, the model put a GPT's plan at 1/1.32 of its compiled peak."""
    from shardplan.ir.graph import Role
    from shardplan.planning.intra_op import plan_graph
    from shardplan.strategies.spec import ShardSpec

    m, graph = _graph("gpt")
    traced = trace(m.fn, m.args, m.state_argnums, m.batch_argnums)
    fixed = {}
    for i, v in enumerate(graph.inputs):
        nd = graph.values[v].ndim
        if graph.input_roles[i] == Role.STATE:
            fixed[i] = ShardSpec.replicated(nd)
        elif graph.input_roles[i] == Role.BATCH and nd:
            fixed[i] = ShardSpec(((mesh8.axis_names[0],),) + ((),) * (nd - 1))
    options = DEFAULTS.replace(time_limit=20.0, deterministic=True, state_argnums=m.state_argnums,
                               batch_argnums=m.batch_argnums)
    job = Job.make(traced, MeshShape.of(mesh8), get_profile("cpu"), options, device_mesh=mesh8)
    plan, _ = plan_graph(job, fixed_inputs=fixed)
    compiled = compiled_mod.compile_for_analysis(
        compiled_mod.lower_plan(graph, traced, plan, mesh8, m.state_argnums))
    assert compiled.as_text().count(" all-reduce(") == 1  # the gradients', combined
    peak = hlo.analyze(compiled).peak_bytes
    assert abs(peak / plan.estimate.peak_bytes - 1) <= TOLERANCE, (peak, plan.estimate.peak_bytes)


def test_a_scattered_gradient_the_plan_reduces_is_held_for_the_combined_all_reduce():
    """A tied embedding's gradient is a scatter-add (the lookup's) plus a dot (the logits'):
    XLA scatters into the add's other operand in place (never written) unless the plan
    reduces the scatter's partial sum itself; then it is an operand of the gradients' combined
    all-reduce, held until it runs, and its result is written with it (GPT on 8 devices: the
    embedding's scattered gradient and its all-reduced copy, 128 KiB at XLA's peak that the
    model missed)."""
    import jax.numpy as jnp

    from shardplan.cost.model import AlphaBetaCost
    from shardplan.intra.problem import Problem
    from shardplan.intra.settings import IntraOptions

    def step(emb, tokens):
        def loss(e):
            h = e[tokens]  # [b, s, d]
            logits = h @ e.T
            return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

        return emb - 0.1 * jax.grad(loss)(emb)

    args = (jnp.ones((64, 16)), jnp.zeros((8, 4), jnp.int32))
    traced = trace(step, args, (0,), (1,))
    graph = lift(traced.closed_jaxpr, traced.arg_info)
    mesh = MeshShape(("d",), (8,))
    problem = Problem(graph, mesh, AlphaBetaCost(mesh, get_profile("cpu")), IntraOptions())
    model = problem.memory()
    scatter = next(n for n in graph.nodes if n.primitive == "scatter-add")
    assert scatter.outputs[0] in model.virtual  # folded into the add when not reduced
    m = problem.num_inputs + scatter.id
    root = problem.groups.root[m]
    held = [b for b in model.buffers if b.root == root and "scatter-add" in b.what
            and "combined all-reduce" in b.what]
    reduced = [b for b in model.buffers if b.root == root and b.what.endswith("all-reduced")]
    assert held and reduced
    nbytes = graph.values[scatter.outputs[0]].nbytes
    for k in range(len(problem.strategies[root])):
        partial = bool(problem.out_spec(m, 0, k).partial)
        # a partial sum of the whole table on every device: its bytes while held, else none
        assert held[0].nbytes[k] == (nbytes if partial else 0), (k, held[0].nbytes[k])
    assert any(problem.out_spec(m, 0, k).partial for k in range(len(problem.strategies[root])))


def test_two_dots_reading_one_layout_of_a_value_share_its_copy():
    """XLA gathers a value once for all the readers that want one layout (the first reader's
    copy is held to the last): at the later dot the model counts that copy and, only when the
    later dot wants another layout, a copy of its own (counted from the source, the later
    dot's copy was counted even when it was the held one)."""
    import jax.numpy as jnp
    import numpy as np

    from shardplan.cost.model import AlphaBetaCost
    from shardplan.intra.problem import Problem
    from shardplan.intra.settings import IntraOptions

    def step(w1, w2, x):
        return jnp.sum(jnp.tanh(x @ w1) * jnp.exp(x @ w2))

    args = (jnp.ones((16, 32)), jnp.ones((16, 32)), jnp.ones((64, 16)))
    traced = trace(step, args, (0, 1), (2,))
    graph = lift(traced.closed_jaxpr, traced.arg_info)
    mesh = MeshShape(("d",), (8,))
    problem = Problem(graph, mesh, AlphaBetaCost(mesh, get_profile("cpu")), IntraOptions())
    model = problem.memory()
    x = graph.inputs[2]
    dots = sorted((n for n in graph.nodes if n.primitive == "dot_general"),
                  key=lambda n: model.pos[n.id])
    assert len(dots) == 2 and all(d.inputs[0] == x for d in dots)
    roots = [problem.groups.root[problem.num_inputs + d.id] for d in dots]
    rx = problem.groups.root[2]
    split = next(k for k in range(len(problem.strategies[rx]))
                 if problem.out_spec(2, 0, k).dims[0])  # x split by rows
    whole = [next(k for k in range(len(problem.strategies[r]))
                  if not any(problem.in_spec(problem.num_inputs + d.id, 0, k).dims))
             for d, r in zip(dots, roots)]  # each dot reads x whole
    choice = {r: 0 for r in problem.roots}
    choice.update({rx: split, roots[0]: whole[0], roots[1]: whole[1]})
    at = model.pos[dots[1].id]
    copies = [c for c in model.copies if c.what.startswith(f"reshard of v{x} ")
              and c.start <= at <= c.end and c.key_a[choice[c.a]] != c.key_b[choice[c.b]]]
    # one gathered x held from the first dot to the second, none of the second's own
    assert len(copies) == 1, [c.what for c in copies]
    assert np.isclose(copies[0].bytes_b[whole[0]], graph.values[x].nbytes)


def test_a_convolution_reading_its_operand_in_another_layout_holds_a_transposed_copy():
    """XLA:CPU convolves NHWC images with HWIO kernels: the kernel gradient's convolution reads
    the images with their channels as its batch, so XLA copies them transposed, at the start
    (only inputs feed the copy), and holds the copy to the backward convolution (ViT at test
    size on 8 devices: 96 KiB live from the start that the model missed, compiled 1.074x its
    estimate). The forward convolution reads them as they are: no copy."""
    from shardplan.cost.model import AlphaBetaCost
    from shardplan.intra.problem import Problem
    from shardplan.intra.settings import IntraOptions

    _, graph = _graph("vit")
    mesh = MeshShape(("d",), (8,))
    problem = Problem(graph, mesh, AlphaBetaCost(mesh, get_profile("cpu")), IntraOptions())
    model = problem.memory()
    convs = [n for n in graph.nodes if n.primitive == "conv_general_dilated"]
    images = convs[0].inputs[0]
    assert images in graph.inputs and len(convs) == 2
    copies = [b for b in model.buffers if "transposed for" in b.what]
    backward = [b for b in copies if b.what.startswith(f"v{images} ")]
    assert len(backward) == 1 and backward[0].start == model.first
    assert backward[0].end == model.pos[convs[1].id]
    assert not any(b.end == model.pos[convs[0].id] for b in copies)  # the forward reads NHWC
    assert backward[0].nbytes.max() >= graph.values[images].nbytes / 8


def test_a_layer_norms_backward_reductions_hold_their_broadcast_operands_when_large():
    """XLA:CPU reduces through YNNPACK from 4096 elements per device on, fusing the product a
    reduction reads but not that product's broadcast operand: a layer norm's backward reduces
    the incoming gradient times its scale [1, 1, h] and times its 1/std [b, s, 1], and XLA
    writes both broadcast to the activation's shape, in the forward pass (the scale's at the
    start: only inputs feed it), and holds them to the backward reductions (ViT at test size
    on 8 devices, [8, 17, 64] whole: 8 such buffers, a fifth of its compiled peak). Split 8
    ways (1088 elements a device), XLA reduces with its own emitter and holds none (GPT at
    test size on 8 devices, its batch split: none in its compiled program)."""
    from shardplan.cost.model import AlphaBetaCost
    from shardplan.intra.problem import Problem
    from shardplan.intra.settings import IntraOptions

    mesh = MeshShape(("d",), (8,))
    _, graph = _graph("vit")
    problem = Problem(graph, mesh, AlphaBetaCost(mesh, get_profile("cpu")), IntraOptions())
    model = problem.memory()
    held = [b for b in model.buffers if "broadcast for the reduction" in b.what]
    norms = {n.name for n in graph.nodes
             if n.name.startswith("jvp(") and n.name.endswith(("ln_1", "ln_2"))}
    backward = min(model.pos[n.id] for n in graph.nodes if n.primitive == "dot_general"
                   and n.name.startswith("transpose("))
    assert len(norms) == 4 and len(held) == 2 * len(norms)
    for b in held:
        assert b.start < backward < b.end
        assert set(b.nbytes) == {0.0, 8 * 17 * 64 * 4}  # whole or partial: held; split: not


def _stacked_weights_step(loss):
    """(graph, mesh of 8) of an SGD step of `loss(ws, x)` over 4 stacked 16 x 16 f32 weights."""
    import jax.numpy as jnp

    def step(ws, x):
        return ws - 0.1 * jax.grad(loss)(ws, x)

    args = (jnp.ones((4, 16, 16)), jnp.ones((64, 16), jnp.bfloat16))
    traced = trace(step, args, (0,), (1,))
    return lift(traced.closed_jaxpr, traced.arg_info), MeshShape(("d",), (8,))


def test_a_stacked_weight_resharded_for_its_scan_is_held_through_the_loop():
    """A scan's stacked input read in another layout than it is made in is resharded whole
    before the loop and passed into it, held to the loop's end (the TPU compiler, Llama2-70B
    on 16x16: each stacked weight, cast to bf16, gathered over `data` for all 80 layers at
    once, 9 GiB a chip held through the loops, where the model held the copy only where the
    loop slices it)."""
    import jax.numpy as jnp

    from shardplan.cost.model import AlphaBetaCost
    from shardplan.intra.problem import Problem
    from shardplan.intra.settings import IntraOptions

    def loss(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws.astype(jnp.bfloat16))
        return jnp.sum(h)

    graph, mesh = _stacked_weights_step(loss)
    problem = Problem(graph, mesh, AlphaBetaCost(mesh, get_profile("cpu")), IntraOptions())
    model = problem.memory()
    cast = next(n for n in graph.nodes if n.primitive == "convert_element_type"
                and n.inputs[0] == graph.inputs[0])
    stack = cast.outputs[0]
    reads = [n for n in graph.nodes if n.primitive == "loop_slice" and n.inputs[0] == stack]
    assert len(reads) == 2  # the forward loop and the backward one
    n_in = problem.num_inputs
    rc = problem.groups.root[n_in + cast.id]
    split = next(k for k in range(len(problem.strategies[rc]))
                 if problem.out_spec(n_in + cast.id, 0, k).dims[1])  # split by rows
    for read in reads:
        loop = graph.loops[read.loop]
        end = max(model.pos[n] for n in [*loop.bodies[-1].nodes, *loop.leave])
        assert end > model.pos[read.id]
        rr = problem.groups.root[n_in + read.id]
        assert rr != rc
        whole = next(k for k in range(len(problem.strategies[rr]))
                     if not any(problem.in_spec(n_in + read.id, 0, k).dims))
        copy = next(c for c in model.copies if c.b == rr and c.what.startswith(
            f"reshard of v{stack} for loop_slice") and c.key_a[split] != c.key_b[whole])
        assert copy.start == model.pos[read.id] and copy.end >= end


def test_a_stacked_weight_cast_in_its_scan_is_cast_whole_before_it_on_tpu():
    """A scan's f32 stacked weights cast to bf16 in its body: the TPU compiler casts the whole
    stack before the loop and slices the cast, one cast for the forward and the backward scan,
    held through both (Llama2-70B on v5p 16x16: bf16 [80, 512, 1792] casts of the MLP's
    stacks, 140 MiB each a chip, live from before the backward scan to its end). XLA:CPU's
    rules hold no such buffer."""
    import jax.numpy as jnp

    from shardplan.cost.model import AlphaBetaCost
    from shardplan.intra.problem import Problem
    from shardplan.intra.settings import IntraOptions

    def layer(h, w):  # rematerialized: the backward scan slices and casts the stack again
        return jnp.tanh(h @ w.astype(jnp.bfloat16)), None

    def loss(ws, x):
        return jnp.sum(jax.lax.scan(jax.checkpoint(layer), x, ws)[0])

    graph, mesh = _stacked_weights_step(loss)
    cost = AlphaBetaCost(mesh, get_profile("cpu"))
    tpu = Problem(graph, mesh, cost, IntraOptions(compiler="tpu")).memory()
    cpu = Problem(graph, mesh, cost, IntraOptions(compiler="cpu")).memory()
    assert not [b for b in cpu.buffers if "cast whole" in b.what]
    casts = [b for b in tpu.buffers if "cast whole before its scan" in b.what]
    assert len(casts) == 1  # one for both loops
    (cast,) = casts
    loops = [lp for lp in graph.loops if lp.kind == "scan"]
    assert len(loops) == 2
    body = [tpu.pos[n] for lp in loops for b in lp.bodies for n in b.nodes]
    assert cast.start <= min(body) and cast.end >= max(body)
    # the whole stack in bf16, split as the cast in the body is, in the TPU's tiles (each
    # 16-wide row padded to 128): 4 x 16 x 128 x 2 bytes whole, split 8 ways [4, 2, 16] in
    # tiles of 2 rows: 4 x 2 x 128 x 2
    assert max(cast.nbytes) == pytest.approx(tpu.scale * 4 * 16 * 128 * 2)
    assert min(cast.nbytes) == pytest.approx(tpu.scale * 4 * 2 * 128 * 2)


def _sgd_problem(loss, args, compiler):
    """(graph, Problem) of one SGD step on loss(w1, w2, x), args its ShapeDtypeStructs, on
    2x4 for tpu-v5e, its memory rules the `compiler`'s."""
    from shardplan.cost.model import AlphaBetaCost
    from shardplan.intra.problem import Problem
    from shardplan.intra.settings import IntraOptions

    def step(w1, w2, x):
        g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2, x)
        return w1 - 0.1 * g1, w2 - 0.1 * g2

    traced = trace(step, args, (0, 1), (2,))
    graph = lift(traced.closed_jaxpr, traced.arg_info)
    mesh = MeshShape(("data", "model"), (2, 4))
    cost = AlphaBetaCost(mesh, get_profile("tpu-v5e"))
    return graph, Problem(graph, mesh, cost, IntraOptions(compiler=compiler))


def _sgd_mlp_problem(compiler):
    """Two bf16 dense layers with a relu between, one SGD step, on 2x4 for tpu-v5e (the
    weight gradients' dots contract 1024 rows a device: reshard_prices.WINDOW_CONTRACTING)."""
    import jax.numpy as jnp

    def loss(w1, w2, x):
        return jnp.sum((jax.nn.relu(x @ w1 + 1.0) @ w2).astype(jnp.float32))

    w = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
    return _sgd_problem(loss, (w, w, jax.ShapeDtypeStruct((8192, 1024), jnp.bfloat16)),
                        compiler)


def test_a_copy_read_by_a_recomputed_value_is_held_to_that_values_last_read():
    """A reshard's copy read by an elementwise op the TPU compiler recomputes in each reader
    (a residual add) is held until the last read of what is fused into that op, the backward
    pass's, not only to the op. GPT-2 124M on v5e: its MLP's output, reduced into the
    residual stream, was freed at the add while the backward pass read the residual (FSDP at
    0.71 of the compiled peak on 2x4 and 0.58 on 4x4; 0.82 and 0.72 held to the read; the
    searched plans 1.03 and 0.996)."""
    import jax.numpy as jnp

    def loss(w1, w2, x):
        residual = x + 2.0 * (x @ w1)
        return jnp.sum(jnp.tanh(residual) @ w2)

    w = jax.ShapeDtypeStruct((512, 512), jnp.float32)
    graph, problem = _sgd_problem(loss, (w, w, jax.ShapeDtypeStruct((256, 512), jnp.float32)),
                                  "tpu")
    model = problem.memory()
    dot = next(n for n in graph.nodes if n.primitive == "dot_general")
    (scaled,) = [n.outputs[0] for n in graph.nodes if dot.outputs[0] in n.inputs]
    (add,) = [n for n in graph.nodes if scaled in n.inputs]
    assert add.primitive == "add" and add.outputs[0] in model.virtual  # recomputed
    last = model.last[add.outputs[0]]
    assert last > model.pos[add.id]  # where the backward pass reads the residual
    (copy,) = [c for c in model.copies if c.what == f"reshard of v{scaled} for add {add.name}"]
    # made where the add runs, in the first reader it is fused into
    assert copy.start == model.first_reads[add.outputs[0]] >= model.pos[add.id]
    assert copy.end == last


def test_a_rotary_split_is_recomputed_in_its_readers_on_tpu():
    """jnp.split's halves (a Llama's rotary embedding of q and k) are slices the TPU compiler
    takes into each reader's fusion, recomputed from q: never written (tests/
    test_memory_tpu.py's Llama on v5e 2x4 held none of the eight 8 MiB halves its estimate
    counted: 1.31 of the compiled peak, 1.22 without them). XLA:CPU writes them."""
    import jax.numpy as jnp

    def loss(w1, w2, x):
        q1, q2 = jnp.split(x @ w1, 2, axis=-1)
        cos, sin = jnp.cos(x[:, :128]), jnp.sin(x[:, :128])
        rotated = jnp.concatenate([q1 * cos - q2 * sin, q2 * cos + q1 * sin], axis=-1)
        return jnp.sum(jnp.tanh(rotated) @ w2)

    w = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    args = (w, w, jax.ShapeDtypeStruct((512, 256), jnp.float32))
    for compiler, written in (("tpu", False), ("cpu", True)):
        graph, problem = _sgd_problem(loss, args, compiler)
        (split,) = [n for n in graph.nodes
                    if n.primitive == "split" and "transpose" not in n.name]
        model = problem.memory()
        assert all((v not in model.virtual) == written for v in split.outputs)


def test_an_activation_is_written_where_a_windowed_dot_reads_it():
    """On the TPU compiler a relu of a dot's output, which the next dot and its weight
    gradient's dot read, is recomputed in their fusions, but where the weight gradient's dot
    runs as a windowed einsum (its partial sum over the whole slice, reduce-scattered over it)
    the relu is that loop's operand, written whole: a copy over the dot's choice and its
    reader's. tests/test_memory_tpu.py's MLP on v5e 2x4: 1.42 of the compiled peak with the
    relu always written (its 2-D plan windows nothing), FSDP 0.77 with it never written."""
    import numpy as np

    from shardplan.intra.memory import windows

    graph, problem = _sgd_mlp_problem("tpu")
    model = problem.memory()
    relu = next(n for n in graph.nodes if n.primitive == "max")
    assert relu.outputs[0] in model.virtual  # not written in itself
    copies = [c for c in model.copies if c.what.endswith("a windowed dot's operand")]
    assert len(copies) == 1 and copies[0].what.startswith("max ")
    (dot,) = [d for d in model.windows if relu.outputs[0] in graph.nodes[d].inputs]
    may, scattering = model.windows[dot]
    root = problem.groups.root
    rd, (n, scatters) = root[problem.num_inputs + dot], scattering[0]
    choice = {r: 0 for r in problem.roots}
    for k_dot, k_reader, written in ((np.argmax(may), np.argmax(scatters), True),
                                     (np.argmax(may), np.argmin(scatters), False),
                                     (np.argmin(may), np.argmax(scatters), False)):
        choice.update({rd: int(k_dot), root[n]: int(k_reader)})
        assert (dot in windows.windowed(model, choice)) == written
        held = [b for _, _, b, w in model.live(choice) if w == copies[0].what]
        assert bool(held and held[0] > 0) == written
    # XLA:CPU windows nothing
    cpu = _sgd_mlp_problem("cpu")[1].memory()
    assert not cpu.windows and not any("windowed" in c.what for c in cpu.copies)


def test_a_slice_is_taken_into_its_readers_fusion_on_tpu():
    """A reshard that only slices (the batch split over `data`, read split over the slice)
    is a dynamic slice the TPU compiler runs inside the reading dot's fusion: no copy in the
    plan's peak (the MLP of tests/test_memory_tpu.py on v5e 2x4: its batch and target, 64
    and 128 MiB a chip, were counted); on XLA:CPU it is a copy."""
    from shardplan.intra.memory import windows
    from shardplan.intra.memory.windows import slices_only
    from shardplan.strategies.spec import ShardSpec

    assert slices_only(ShardSpec((("data",), ())), ShardSpec((("data", "model"), ())))
    assert not slices_only(ShardSpec((("data",), ())), ShardSpec((("model", "data"), ())))
    assert not slices_only(ShardSpec((("data",), ())), ShardSpec(((), ("data",))))
    for compiler, counted in (("tpu", False), ("cpu", True)):
        graph, problem = _sgd_mlp_problem(compiler)
        model = problem.memory()
        x = graph.inputs[2]
        first = min((n for n in graph.nodes if x in n.inputs), key=lambda n: model.pos[n.id])
        (copy,) = [c for c in model.copies if c.what == f"reshard of v{x} for dot_general "
                   f"{first.name}"]
        src = next(k for k in range(len(problem.strategies[copy.a]))
                   if problem.out_spec(2, 0, k) == ShardSpec((("data",), ())))
        dst = next(k for k in range(len(problem.strategies[copy.b]))
                   if problem.in_spec(problem.num_inputs + first.id, 0, k)
                   == ShardSpec((("data", "model"), ())))
        choice = {r: 0 for r in problem.roots}
        choice.update({copy.a: src, copy.b: dst})
        # what no windowed dot reads (the choice of every other member is its first)
        assert not windows.windowed(model, choice) & (copy.sliced or (None, None, set()))[2]
        assert any(w == copy.what for *_, w in model.live(choice)) == counted


def test_a_weight_transposed_for_its_dot_is_resharded_where_the_dot_runs_on_tpu():
    """The transpose of a weight that only the inputs feed runs first in the list schedule,
    but the TPU compiler fuses it into its dot and gathers the weight a few ops before it
    (compilers.TPU.hoisted_gathers: GPT-2 124M's embedding, 74 MiB a chip on v5e 4x4, read
    as the logits' kernel): the copy for the transpose starts at the dot."""
    import jax.numpy as jnp

    def loss(w1, w2, x):
        return jnp.sum(jnp.tanh(x @ w1) @ jax.lax.transpose(w2, (1, 0)))

    w = jax.ShapeDtypeStruct((512, 512), jnp.float32)
    graph, problem = _sgd_problem(loss, (w, w, jax.ShapeDtypeStruct((256, 512), jnp.float32)),
                                  "tpu")
    model = problem.memory()
    w2 = graph.inputs[1]
    (transpose,) = [n for n in graph.nodes if n.primitive == "transpose"
                    and w2 in n.inputs and "transpose(" not in n.name]
    dot = min((n for n in graph.nodes if transpose.outputs[0] in n.inputs),
              key=lambda n: model.pos[n.id])
    (copy,) = [c for c in model.copies
               if c.what == f"reshard of v{w2} for transpose {transpose.name}"]
    assert model.pos[transpose.id] < copy.start == model.pos[dot.id]


def test_logits_cast_to_f32_for_the_loss_are_recast_in_the_backward_on_tpu():
    """The loss casts the bf16 logits to f32 for its reductions: the TPU compiler writes the
    cast for the forward pass and recasts the bf16 logits in the backward (GPT-2 124M and the
    zoo's MoE on v5e 4x4: the f32 logits dead 2-4 steps after they are made, the bf16 held),
    so the f32 buffer ends at its last forward read and the bf16 one is held to the backward
    pass's (liveness.recast)."""
    import jax.numpy as jnp

    def loss(w1, w2, x):
        logits = (jnp.tanh(x @ w1) @ w2).astype(jnp.float32)
        labels = (jnp.arange(256) * 7 % 512)[:, None]  # the loss's gather: the cast written
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1)
                        - jnp.take_along_axis(logits, labels, axis=-1)[:, 0])

    w = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16)
    args = (w, w, jax.ShapeDtypeStruct((256, 512), jnp.bfloat16))
    graph, problem = _sgd_problem(loss, args, "tpu")
    model = problem.memory()
    made = {v: n for n in graph.nodes for v in n.outputs}
    (cast,) = [n for n in graph.nodes if n.primitive == "convert_element_type"
               and n.inputs[0] in made and graph.inputs[1] in made[n.inputs[0]].inputs]
    readers = {}
    for n in graph.nodes:
        for v in n.inputs:
            readers.setdefault(v, []).append(n.id)
    # the last reads of the f32 logits in the forward pass and in the backward one
    fwd, bwd = liveness._reads(graph, cast.outputs[0], model.pos, readers, model.virtual)
    assert model.last[cast.outputs[0]] == fwd < bwd <= model.last[cast.inputs[0]]
