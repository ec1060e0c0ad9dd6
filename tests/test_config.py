"""The CLI's config schema: every shipped YAML loads; bad keys and values name the dotted key."""

import glob
import os

import pytest

from shardplan.config import ConfigError, apply_overrides, load_config, parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))
                 + glob.glob(os.path.join(ROOT, "configs", "bench", "*.yaml")))
BASE = {"model": {"name": "mlp", "size": "tiny"},
        "cluster": {"hardware": "a100-80gb", "mesh": {"shape": [2, 4]}}}


def test_configs_are_shipped():
    names = {os.path.relpath(p, ROOT) for p in SHIPPED}
    assert "configs/demo.yaml" in names
    assert len([n for n in names if n.startswith("configs/bench/")]) >= 5
    assert len(names) >= 12


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: os.path.relpath(p, ROOT))
def test_shipped_config_loads_and_builds(path, devices):
    from shardplan.workload import build_workload

    config = load_config(path)
    assert config.description, "every shipped config says what it is"
    assert config.budget_bytes() > 0
    work = build_workload(config)  # the zoo accepts the size and overrides (abstract args)
    assert work.num_params > 0 and work.step is not None
    with open(path) as f:
        text = f.read()
    assert config.profile().name in text and "hardware.py" in text, \
        "cite which profile and where its figures come from"


# MaxText's per-device batch (src/maxtext/configs/tpu/v5e/llama2_7b.sh, llama2_70b.sh;
# tests/end_to_end/tpu/mixtral/8x7b/2_test_mixtral.sh)
MAXTEXT_CONFIGS = {"llama2-7b-tpu-v5e-16": 4, "llama2-70b-tpu-v5e-256": 2,
                   "mixtral-8x7b-tpu-v5p-128": 4}


@pytest.mark.parametrize("name", sorted(MAXTEXT_CONFIGS))
def test_maxtext_configs_compare_with_maxtexts_configuration(name):
    config = load_config(os.path.join(ROOT, "configs", f"{name}.yaml"))
    assert "maxtext" in config.output.baselines
    assert config.model.batch_size == MAXTEXT_CONFIGS[name] * config.cluster.mesh.num_devices
    assert config.model.seq_len == 2048
    assert config.model.overrides["scan_layers"] and config.model.overrides["remat"] is False
    assert config.search_options().remat is True  # the planner rematerializes, as MaxText
    assert "src/maxtext/configs" in config.description


def _error(data, overrides=()) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_config(apply_overrides(data, overrides))
    return info.value


@pytest.mark.parametrize("override, key, words", [
    ("model.sise=gpt2-124m", "model.sise", ["unknown key", "size"]),
    ("colour=red", "colour", ["unknown key", "model, cluster, search, output"]),
    ("cluster.mesh.shap=[2, 4]", "cluster.mesh.shap", ["shape, axes, devices"]),
    ("search.pipelin=true", "search.pipelin", ["num_micro_batches"]),
    ("output.format=[json]", "output.format", ["formats"]),
])
def test_unknown_keys_are_named_with_the_allowed_ones(override, key, words):
    e = _error(BASE, [override])
    assert e.key == key
    for w in words:
        assert w in str(e)


@pytest.mark.parametrize("override, key, words", [
    ("search.pipeline=sometimes", "search.pipeline", ["true, false, auto, spmd or mpmd"]),
    ("search.pipeline=3", "search.pipeline", ["true, false, auto, spmd or mpmd", "3"]),
    ("search.schedule=zigzag", "search.schedule", ["1f1b", "gpipe"]),
    ("search.time_limit=-1", "search.time_limit", ["greater than 0"]),
    ("search.num_micro_batches=0", "search.num_micro_batches", ["greater than or equal to 1"]),
    ("cluster.memory_budget=lots", "cluster.memory_budget", ["16GiB"]),
    ("model.dtype=float64", "model.dtype", ["bfloat16"]),
    ("model.batch_size=0", "model.batch_size", ["greater than 0"]),
    ("output.formats=[pdf]", "output.formats[0]", ["json", "png"]),
    ("output.baselines=[zero]", "output.baselines[0]", ["fsdp"]),
    ("cluster.mesh.shape=[2, 0]", "cluster.mesh", ["sizes >= 1"]),
    ("cluster.mesh.axes=[data]", "cluster.mesh", ["differ in length"]),
    ("cluster.mesh.axes=[x, x]", "cluster.mesh", ["repeat"]),
    ("cluster.mesh.devices=8", "cluster.mesh", ["either"]),
])
def test_bad_values_name_the_key_and_what_is_allowed(override, key, words):
    e = _error(BASE, [override])
    assert e.key == key, str(e)
    for w in words:
        assert w in str(e), str(e)


@pytest.mark.parametrize("override, key, words", [
    ("model.name=transformer", "model.name", ["gpt", "llama", "wresnet"]),
    ("model.size=huge", "model.size", ["tiny", "100m", "1b"]),
    ("cluster.hardware=tpu-v9", "cluster.hardware", ["tpu-v4", "a100-80gb", ".yaml"]),
    ("cluster.hardware=nowhere.yaml", "cluster.hardware", ["does not exist"]),
    ("model.seq_len=128", "model.seq_len", ["has no seq_len"]),
    ("model.overrides={widht: 8}", "model.overrides.widht", ["width"]),
    ("model.overrides={width: wide}", "model.overrides.width", ["int"]),
    ("model.overrides={batch_size: 4}", "model.overrides.batch_size", ["model.batch_size"]),
])
def test_unknown_models_sizes_and_profiles(override, key, words):
    e = _error(BASE, [override])
    assert e.key == key, str(e)
    for w in words:
        assert w in str(e), str(e)


def test_model_needs_exactly_one_source():
    e = _error({**BASE, "model": {"name": "mlp", "entry": "pkg.mod:fn"}})
    assert e.key == "model" and "either" in str(e)
    e = _error({**BASE, "model": {"entry": "not an entry"}})
    assert "package.module:function" in str(e)


def test_missing_sections_and_several_errors():
    e = _error({"model": {"name": "mlp"}})
    assert e.key == "cluster" and "required" in str(e)
    e = _error(BASE, ["search.time_limit=abc", "extra=1"])
    assert "search.time_limit" in str(e) and "extra" in str(e)


@pytest.mark.parametrize("value, want", [
    ("true", True), ("false", False), ("auto", "auto"), ("spmd", "spmd"), ("mpmd", "mpmd"),
    ("SPMD", "spmd"), ('"false"', False)])
def test_search_pipeline_takes_the_pipeline_modes(value, want):
    config = parse_config(apply_overrides(BASE, [f"search.pipeline={value}"]))
    assert config.search.pipeline == want and type(config.search.pipeline) is type(want)
    assert config.search_options().pipeline == want  # SearchOptions accepts every mode


def test_overrides_parse_yaml_and_create_sections():
    data = apply_overrides(BASE, ["model.size=100m", "cluster.mesh.shape=[8]",
                                  "search.pipeline=false", "cluster.memory_budget=16GiB",
                                  "model.overrides.num_layers=2"])
    assert BASE["model"]["size"] == "tiny", "the input is not modified"
    config = parse_config(data)
    assert config.model.size == "100m"
    assert config.cluster.mesh.shape == (8,)
    assert config.search.pipeline is False
    assert config.cluster.memory_budget == 16 * 2**30
    assert config.model.overrides == {"num_layers": 2}
    for bad in ("model.size", "=3", "model..size=1"):
        with pytest.raises(ConfigError, match="key.path=value"):
            apply_overrides(BASE, [bad])
    with pytest.raises(ConfigError) as info:
        apply_overrides(BASE, ["model.name.first=1"])
    assert info.value.key == "model.name"


def test_defaults_and_mesh_candidates():
    config = parse_config(BASE)
    assert config.budget_bytes() == 80 * 2**30  # the profile's memory
    assert config.search.pipeline == "auto" and config.output.compare
    assert config.cluster.mesh.candidates() == [(("data", "model"), (2, 4))]
    config = parse_config(apply_overrides(BASE, ["cluster.mesh={devices: 12}"]))
    shapes = [s for _, s in config.cluster.mesh.candidates()]
    assert shapes == [(12,), (2, 6), (3, 4), (4, 3), (6, 2)]
    names = {n for n, _ in config.cluster.mesh.candidates()}
    assert names == {("devices",), ("data", "model")}
    config = parse_config(apply_overrides(BASE, ["cluster.mesh={devices: 4, axes: [dp, tp]}"]))
    assert config.cluster.mesh.candidates() == [(("tp",), (4,)), (("dp", "tp"), (2, 2))]


def test_hardware_file_is_relative_to_the_config(tmp_path):
    (tmp_path / "hw").mkdir()
    (tmp_path / "hw" / "small.yaml").write_text(
        "base: a100-80gb\nname: a100-small\nmemory_bytes: 1073741824\n")
    path = tmp_path / "job.yaml"
    path.write_text("model: {name: mlp}\ncluster:\n  hardware: hw/small.yaml\n"
                    "  mesh: {shape: [8]}\n")
    config = load_config(path)
    assert config.profile().name == "a100-small"
    assert config.budget_bytes() == 2**30


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)
    bad.write_text("model: {name: mlp}\ncluster: {hardware: cpu, mesh: {shape: [2]}}\n"
                   "source: x\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert info.value.key == "source" and str(bad) in str(info.value)


def test_hints_load_as_search_options(tmp_path):
    from jax.sharding import PartitionSpec as P

    path = tmp_path / "hints.yaml"
    path.write_text("""
model: {name: mlp, size: tiny}
cluster: {hardware: a100-80gb, mesh: {shape: [2, 4]}}
search:
  hints:
    "0/params/**/kernel": [null, model]
    "2/**": [[data, model]]
    "1/**": null
  logical_axis_rules: [[batch, data], [mlp, model], [embed, null]]
""")
    hints = load_config(path).search_options().hints
    assert hints.pins == (("0/params/**/kernel", P(None, "model")),
                          ("2/**", P(("data", "model"))), ("1/**", P()))
    assert hints.logical_axis_rules == (("batch", "data"), ("mlp", "model"), ("embed", None))
    assert not parse_config(BASE).search_options().hints
    for mode in ("true", "spmd", "mpmd"):
        e = _error(BASE, ['search.hints={"2/**": [data]}', f"search.pipeline={mode}"])
        assert e.key == "search" and "pipeline" in str(e)
    e = _error(BASE, ["search.hints=[data]"])
    assert e.key == "search.hints"
