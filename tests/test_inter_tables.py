"""The stage DP's cost tables: repeated layers planned once, ranges priced as the sum of their
layers plus the transfer of their inputs."""

import pytest

from shardplan.inter import planner, stage_io
from shardplan.inter import split as sp
from shardplan.inter import tables as tables_mod
from shardplan.intra.settings import IntraOptions, SolverSettings
from shardplan.strategies.spec import MeshShape
from tests.test_inter_planner import SLOW
from tests.test_inter_split import mlp_step


def test_repeated_layers_are_planned_once_and_tables_are_consistent():
    step, args, _ = mlp_step(num_layers=8, width=64, batch=16, abstract=True)
    s = sp.split_step(step, args, num_micro_batches=4)
    cluster = tables_mod.Cluster.of(MeshShape(("d",), (8,)), SLOW)
    assert (cluster.num_hosts, cluster.per_host) == (2, 4)
    cache = tables_mod.CostTables(SLOW, cluster, IntraOptions(
        solver=SolverSettings(time_limit=10, deterministic=True)))
    tables = tables_mod.build_tables(s, stage_io.layer_groups(s, 8), cache, SLOW, None)
    assert cache.num_ilps == 3 * len(tables.shapes)  # first, middle (x6), last layer
    mid = [tables.costs[k] for k in range(1, 7)]
    assert all(row == mid[0] for row in mid)
    problem = tables.problem()
    L = problem.num_layers
    for m in range(len(tables.shapes)):
        full = sum(c[m].time_s for c in tables.costs)
        assert problem.cost[0, L - 1, m] == pytest.approx(full)
        # later stages also receive their activations over the link between hosts
        assert problem.cost[1, L - 1, m] > sum(c[m].time_s for c in tables.costs[1:])
    assert planner.uniform_option(tables, cluster, 2, SLOW).num_stages == 2
    assert planner.uniform_option(tables, cluster, 3, SLOW) is None
