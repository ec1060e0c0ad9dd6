"""Deprecated alias of shardplan.intra.experts.expert_inputs, kept only because
shardplan.intra.planner (being rewritten) still imports it: delete this module once the
planner calls experts.expert_inputs."""

from shardplan.intra.experts import expert_inputs as seeds

__all__ = ["seeds"]
