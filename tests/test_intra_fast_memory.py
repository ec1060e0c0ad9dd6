"""What HBM holds once the TPU compiler has moved short-lived buffers into a core's on-chip
memory (shardplan/intra/memory/fast_memory.py); tests/test_memory_tpu.py checks the estimates
it gives against the TPU compiler's heap peak."""

import pytest

from shardplan.cost.hardware import PROFILES, HardwareProfile, get_profile
from shardplan.intra.memory import fast_memory

MiB = 2**20
# a step of 100 positions: a buffer of at most 6 of them is short-lived
STATE = (0, 99, 100 * MiB, "input")


def test_short_lived_buffers_are_held_on_chip_largest_first_as_they_fit():
    items = [STATE, (50, 51, 30 * MiB, "logits, bf16"), (50, 52, 40 * MiB, "logits, f32")]
    assert fast_memory.hbm_peak(items, 100, 0) == 170 * MiB
    # the 40 MiB placed first; the 30 MiB do not fit beside them in 50 MiB
    assert fast_memory.hbm_peak(items, 100, 50 * MiB) == 130 * MiB
    assert fast_memory.hbm_peak(items, 100, 70 * MiB) == 100 * MiB


def test_a_buffer_held_for_the_backward_pass_stays_in_hbm():
    saved = (20, 80, 30 * MiB, "activation held for the backward pass")
    assert fast_memory.hbm_peak([STATE, saved], 100, 112 * MiB) == 130 * MiB


def test_a_buffer_that_does_not_fit_beside_those_placed_for_its_whole_life_stays_in_hbm():
    # 80 MiB on chip over [44, 46]; the 60 MiB over [40, 45] would need 140 at 44 and 45
    items = [STATE, (40, 45, 60 * MiB, "scores"), (44, 46, 80 * MiB, "logits")]
    assert fast_memory.hbm_peak(items, 100, 112 * MiB) == 160 * MiB


def test_each_tpu_profile_has_the_on_chip_memory_its_compiler_was_seen_to_fill():
    assert get_profile("tpu-v5e").fast_memory_bytes == 112 * MiB
    assert {n: p.fast_memory_bytes > 0 for n, p in PROFILES.items()} == {
        n: p.backend == "tpu" for n, p in PROFILES.items()}


def test_a_profile_file_may_leave_fast_memory_out_but_not_give_it_negative():
    data = get_profile("a100-80gb").to_dict()
    del data["fast_memory_bytes"]
    assert HardwareProfile.from_dict(data).fast_memory_bytes == 0
    with pytest.raises(ValueError, match="fast_memory_bytes must be an int >= 0"):
        HardwareProfile.from_dict({**data, "fast_memory_bytes": -1})


def test_a_buffer_fits_on_chip_by_its_size_not_by_the_margin_it_is_counted_with():
    # 62.5 MiB of logits counted with the 10% margin (68.75) beside 44 MiB on chip: 106.5 fit
    items = [STATE, (50, 52, 44 * MiB * 1.1, "scores"), (50, 51, 68.75 * MiB, "logits")]
    assert fast_memory.hbm_peak(items, 100, 112 * MiB, 1.1) == 100 * MiB
    # counted as they are, the 68.75 fit and the 48.4 beside them do not
    assert fast_memory.hbm_peak(items, 100, 112 * MiB) == pytest.approx((100 + 44 * 1.1) * MiB)


def test_a_buffer_never_live_is_never_placed():
    # an interval that ends before it starts holds nothing (a copy no reader reads after it
    # is made): Llama2-7B's plan reached one
    items = [STATE, (60, 59, 8 * MiB, "never live"), (50, 51, 30 * MiB, "logits")]
    assert fast_memory.hbm_peak(items, 100, 112 * MiB) == 100 * MiB
