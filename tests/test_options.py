"""SearchOptions: every default once (the intra-op planner, the solver and the config read
them), checked in one place, built from loose user values."""

import pytest

import shardplan
from shardplan.config import SearchSection, parse_config
from shardplan.intra.settings import IntraOptions, SolverSettings
from shardplan.intra.solve.types import SolverInput
from shardplan.options import DEFAULTS, SearchOptions


def test_defaults_are_declared_once():
    intra, solver, section = IntraOptions(), SolverInput(()), SearchSection()
    # the planner and the solver hold one SolverSettings, SearchOptions' fields by their names
    assert intra.solver == solver.solver == SolverSettings.of(DEFAULTS)
    assert intra.solver.time_limit == section.time_limit == DEFAULTS.time_limit
    assert intra.solver.solver_seed == section.solver_seed == DEFAULTS.solver_seed
    assert intra.solver.workers == section.workers == DEFAULTS.workers
    assert not intra.solver.deterministic and not DEFAULTS.deterministic
    assert section.schedule == DEFAULTS.schedule


def test_options_are_checked_when_made():
    with pytest.raises(ValueError, match="pipeline='sometimes'"):
        SearchOptions(pipeline="sometimes")
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        SearchOptions(schedule="zb")
    with pytest.raises(ValueError, match="time_limit"):
        SearchOptions(time_limit=0)
    o = SearchOptions.make(memory_budget="1KiB", state_argnums=[0, 1], solver_seed=3)
    assert (o.memory_budget, o.state_argnums, o.solver_seed) == (1024, (0, 1), 3)
    assert o.replace(workers=2).workers == 2 and o.workers == 1


def test_auto_takes_options_or_their_fields_not_both():
    step = shardplan.auto(lambda x: x, time_limit=5.0, schedule="gpipe")
    assert step.options == SearchOptions(time_limit=5.0, schedule="gpipe")
    with pytest.raises(TypeError, match="not both"):
        shardplan.auto(lambda x: x, options=SearchOptions(), time_limit=5.0)
    with pytest.raises(TypeError, match="unknown option.*seed.*solver_seed"):
        shardplan.auto(lambda x: x, seed=1)  # the solver's seed is solver_seed


def test_config_builds_the_options():
    config = parse_config({"model": {"name": "mlp"},
                           "cluster": {"hardware": "cpu", "mesh": {"devices": 8},
                                       "memory_budget": "1GiB"},
                           "search": {"time_limit": 7, "solver_seed": 2}})
    o = config.search_options()
    assert (o.time_limit, o.solver_seed, o.memory_budget, o.pipeline) == (7.0, 2, 2**30, "auto")
