"""shardplan.planning.compiled: what its fast compile reads is what a full compile gives."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.planning import compiled
from tests.conftest import auto_mesh


def test_fast_compile_reads_the_program_a_full_compile_makes(devices):
    """FAST_COMPILE acts on the CPU code only: the partitioned HLO (its collectives), the
    buffers (memory_analysis) and cost_analysis() are those of a compile without it."""
    mesh = auto_mesh((2, 4), ("data", "model"))

    def step(w1, w2, x):
        grads = jax.grad(lambda a, b: jnp.sum(jnp.tanh(x @ a) @ b), argnums=(0, 1))(w1, w2)
        return w1 - 0.1 * grads[0], w2 - 0.1 * grads[1]

    shardings = [NamedSharding(mesh, s) for s in (P(None, "model"), P("model", None),
                                                   P("data", None))]
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((256, 512), (512, 256), (64, 256))]
    lowered = jax.jit(step, in_shardings=shardings).lower(*args)
    full, fast = lowered.compile(), compiled.compile_for_analysis(lowered)
    assert fast.as_text() == full.as_text()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
              "alias_size_in_bytes")
    assert [getattr(fast.memory_analysis(), f) for f in fields] == [
        getattr(full.memory_analysis(), f) for f in fields]
    assert fast.cost_analysis() == full.cost_analysis()
