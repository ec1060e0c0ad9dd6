"""Flops of while loops (shardplan.analysis.hlo_flops): cost_analysis() counts a loop body
once; analyze() adds the other iterations, so a scan of layers costs what the same layers
unrolled cost."""

import jax
import jax.numpy as jnp
import pytest

from shardplan.analysis import hlo, hlo_flops


def scanned(x, ws):
    return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w) + 1, None), x, ws)[0]


def unrolled(x, ws):
    for i in range(ws.shape[0]):
        x = jnp.tanh(x @ ws[i]) + 1
    return x


@pytest.mark.parametrize("grad", [False, True])
def test_a_scan_costs_its_unrolled_layers(grad):
    x, ws = jnp.ones((64, 64)), jnp.ones((10, 64, 64))

    def compiled(f):
        g = jax.grad(lambda x, w: f(x, w).sum()) if grad else f
        return jax.jit(g).lower(x, ws).compile()

    loop, flat = compiled(scanned), compiled(unrolled)
    once = float(loop.cost_analysis()["flops"])
    want = float(flat.cost_analysis()["flops"])
    assert once < want / 5  # XLA counts the body once
    stats = hlo.analyze(loop)
    assert stats.flops == pytest.approx(want, rel=1e-2)
    assert stats.loop_flops > 0 and hlo.analyze(flat).loop_flops == 0
    # the counter's own rules agree with cost_analysis() on the loop-free program
    assert hlo_flops.program_flops(flat.as_text()) == pytest.approx(want, rel=1e-2)
