"""The config tree: loading, overrides, validation errors, round trips."""

import pytest

from rayvit.config import from_dict, load_config, load_study
from rayvit.config_schema import Config
from rayvit.errors import ConfigError


def test_defaults_validate_and_round_trip(tmp_path):
    cfg = load_config()
    assert from_dict(cfg.to_dict()) == cfg
    path = tmp_path / "cfg.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg


def test_yaml_and_overrides_are_typed(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  name: vit_b16\n  image_size: 224\ntrain:\n  batch_size: 8\n")
    study = load_study(path, ["optim.lr=3e-4", "train.steps=7", "parallel.use_gpu=false",
                              "sweep.worker_counts=1,2,4", "model.classifier=pooled"])
    cfg = study.run
    assert cfg.model.hidden_dim == 768 and cfg.model.depth == 12 and cfg.model.patch_size == 16
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.train.steps == 7 and cfg.train.batch_size == 8
    assert study.sweep.worker_counts == [1, 2, 4]
    assert cfg.flatten()["model.classifier"] == "pooled"


@pytest.mark.parametrize("override, words", [
    ("model.nam=vit_b16", ["model.nam", "allowed", "name"]),
    ("modle.name=vit_b16", ["modle", "allowed", "model"]),
    ("model.stem=resnet", ["model.stem", "resnet", "patchify", "conv"]),
    ("precision.mode=o2", ["precision.mode", "fp32", "amp", "mixed", "pure"]),
    ("train.steps=many", ["train.steps", "many", "integer"]),
    ("train.batch_size=0", ["train.batch_size", "positive"]),
    ("model.image_size=30", ["model.image_size=30", "model.patch_size=4"]),
    ("model.num_heads=3", ["model.num_heads=3", "hidden_dim=64"]),
    ("train.warmup_steps=20", ["train.warmup_steps", "train.steps"]),
    ("parallel.strategy=fairscale_fsdp", ["fairscale_fsdp", "CUDA", "parallel.strategy=fsdp"]),
    ("sweep.strategies=fsdp", ["ddp", "baseline"]),
    ("train.failure_timeout_s=0", ["train.failure_timeout_s=0", "positive"]),
    ("train.fail_mode=oom", ["train.fail_mode", "raise", "exit", "nan"]),
    ("model.compile_backend=tvm", ["model.compile_backend", "inductor", "aot_eager", "eager"]),
])
def test_bad_values_name_key_value_and_what_is_allowed(override, words):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    for word in words:
        assert word in str(err.value)


def test_conv_stem_strides_must_multiply_to_patch():
    cfg = load_config(overrides=["model.stem=conv"])          # derived: log2(4) stride-2 convs
    assert cfg.model.conv_stem_strides == [2, 2]
    with pytest.raises(ConfigError, match="multiply to 8"):
        load_config(overrides=["model.stem=conv", "model.conv_stem_strides=2,4", "model.conv_stem_dims=8,16"])


def test_preset_conflicts_are_refused():
    with pytest.raises(ConfigError, match="model.name=custom"):
        load_config(overrides=["model.name=vit_s16", "model.hidden_dim=100"])


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_replace_returns_validated_copy():
    cfg = Config()
    other = cfg.replace(["parallel.num_workers=2"])
    assert other.parallel.num_workers == 2 and cfg.parallel.num_workers == 1
    with pytest.raises(ConfigError):
        cfg.replace({"parallel.num_workers": 0})


def test_model_compile_is_decided_when_the_config_loads():
    for strategy in ("ddp", "fsdp", "fairscale_oss"):
        assert load_config(overrides=[f"parallel.strategy={strategy}", "model.compile=true"]).model.compile
    # FairScale FSDP cannot run compiled: refused at load, saying why and what runs instead (on GPUs, where
    # the strategy itself is allowed).
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["parallel.strategy=fairscale_fsdp", "parallel.use_gpu=true", "model.compile=true"])
    for words in ("model.compile=true", "parallel.strategy=fairscale_fsdp", "does not support torch.compile",
                  "parallel.strategy=fsdp", "model.compile=false"):
        assert words in str(err.value)
    assert not load_config(overrides=["parallel.strategy=fairscale_fsdp", "parallel.use_gpu=true"]).model.compile
    # The step that compiles must be a warm-up step, never a timed one.
    with pytest.raises(ConfigError, match=r"model.compile=true needs train.warmup_steps >= 1 \(got 0\)"):
        load_config(overrides=["model.compile=true", "train.warmup_steps=0"])


def test_train_compile_is_read_as_model_compile_with_a_warning(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("train:\n  compile: true\n  steps: 7\n")
    with pytest.warns(FutureWarning, match="train.compile is now model.compile"):
        cfg = load_config(path)
    assert cfg.model.compile and cfg.train.steps == 7 and "train.compile" not in cfg.flatten()
    # An override of either name wins over the file; the old name in an override works too.
    with pytest.warns(FutureWarning):
        assert not load_config(path, ["model.compile=false"]).model.compile
    with pytest.warns(FutureWarning):
        assert load_config(overrides=["train.compile=true"]).model.compile
    with pytest.warns(FutureWarning):
        assert not load_config().replace({"train.compile": False}).model.compile
    # Where the renamed key meets the new validation, the message names the new key.
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="model.compile=true cannot run"):
        load_config(overrides=["train.compile=true", "parallel.strategy=fairscale_fsdp", "parallel.use_gpu=true"])
