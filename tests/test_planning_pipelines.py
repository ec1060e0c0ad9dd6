"""planning.pipelines.choose: a pipeline where slow links between hosts make it pay, one
stage on fast uniform links, and the reasons in the plan's notes."""

from shardplan.options import SearchOptions
from shardplan.planning.pipelines import choose
from tests.test_inter_planner import FAST, SLOW
from tests.test_inter_split import mlp_step


def _deep_mlp():
    # compute-bound micro-batches, activations far smaller than the gradients
    return mlp_step(num_layers=16, width=4096, batch=2048, abstract=True)[:2]


def test_slow_links_between_hosts_choose_a_pipeline(mesh2x4):
    step, args = _deep_mlp()
    choice = choose(step, args, mesh2x4, SLOW,
                    SearchOptions(pipeline="auto", num_micro_batches=8))
    assert choice.pipelined and choice.pipeline.num_stages >= 2
    text = choice.explanation
    assert "pipeline stages" in text and "pure intra-op" in text and "<- chosen" in text
    assert "between hosts" in text
    assert choice.pipeline.chosen.total_s < choice.intra.estimate.total_s
    assert any(line in choice.plan.summary() for line in text.splitlines()[:2])
    # every stage sits within one host: only activations cross the slow link
    for st in choice.plan.stages:
        assert len({d // 4 for d in st.devices}) == 1


def test_fast_uniform_links_choose_one_stage(mesh8):
    step, args = _deep_mlp()
    choice = choose(step, args, mesh8, FAST, SearchOptions(pipeline="auto", num_micro_batches=8))
    assert not choice.pipelined and not choice.plan.stages
    assert choice.explanation.startswith("one stage (pure intra-op)")
    assert choice.pipeline.chosen.total_s > choice.intra.estimate.total_s
    assert "bubble" in choice.explanation
    off = choose(step, args, mesh8, FAST, SearchOptions(pipeline=False))
    assert not off.pipelined and off.pipeline is None
