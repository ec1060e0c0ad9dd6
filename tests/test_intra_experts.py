"""The expert plans exist once: the tables the ILP is seeded with (from the traced step's
input names) are the baselines' shardings (from the TrainStep's pytrees)."""

import jax
import pytest

from shardplan import baselines
from shardplan.intra import experts
from shardplan.ir.graph import Role
from shardplan.ir.lift import lift
from shardplan.ir.trace import trace
from shardplan.models import get_model
from shardplan.strategies.spec import MeshShape, ShardSpec


@pytest.mark.parametrize("model", ["gpt", "mlp", "wresnet"])
def test_seed_tables_are_the_baselines(model, mesh2x4):
    step = get_model(model, abstract=True)
    traced = trace(step.fn, step.args, step.state_argnums, step.batch_argnums)
    graph = lift(traced.closed_jaxpr, traced.arg_info)
    tables = experts.expert_inputs(graph, MeshShape.of(mesh2x4))
    assert list(tables) == baselines.applicable_baselines(step, mesh2x4)
    for name, specs in tables.items():
        ins, _ = baselines.baseline_shardings(name, step, mesh2x4)
        got = [s.spec for s in jax.tree.leaves(ins)]
        assert got == [specs[i].to_partition_spec() for i in range(len(graph.inputs))], name


def test_rules_fall_back_to_replicated():
    mesh = MeshShape(("x",), (8,))
    assert experts.rule_spec("0/layer_0/mlp/fc_in/kernel", (16, 64), experts.MEGATRON_RULES,
                             ("x",), mesh) == ShardSpec.split(2, 1, ("x",))
    assert experts.rule_spec("0/wte/embedding", (100, 16), experts.MEGATRON_RULES, ("x",),
                             mesh) == ShardSpec.replicated(2)  # 100 rows do not split 8 ways
    assert experts.largest_dim_spec((3, 5), ("x",), mesh) == ShardSpec.replicated(2)
    specs = experts.input_specs("megatron", ["a/b"], [(8,)], [Role.BATCH], mesh, ("x",))
    assert specs == (ShardSpec.replicated(1),)  # the batch stays whole on the tensor axis


def test_a_batch_too_small_for_every_axis_is_split_over_the_first_that_divide_it():
    """A batch of 8 on 8x8: data parallel splits it over `data` (as an expert writes it), not
    replicated over both axes (every device computing the whole step: 74 ms against 10 for
    the searched GPT-2 124M on 8x8, a100)."""
    mesh = MeshShape(("data", "model"), (8, 8))
    axes = ("data", "model")
    for expert in ("data_parallel", "fsdp"):
        specs = experts.input_specs(expert, ["batch/x"], [(8, 1024)], [Role.BATCH], mesh, axes)
        assert specs == (ShardSpec.split(2, 0, ("data",)),), expert
    specs = experts.input_specs("data_parallel", ["batch/x"], [(64, 1024)], [Role.BATCH], mesh,
                                axes)
    assert specs == (ShardSpec.split(2, 0, ("data", "model")),)
    specs = experts.input_specs("data_parallel", ["batch/x"], [(3, 1024)], [Role.BATCH], mesh,
                                axes)
    assert specs == (ShardSpec.replicated(2),)
