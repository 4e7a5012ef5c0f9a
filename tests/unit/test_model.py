"""The ViT: exact parameter counts, layouts, options, and the analytic FLOP count."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rayvit.models import vit_complexity
from rayvit.config import load_config
from rayvit.models import build_model


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def test_vit_b16_has_the_standard_parameter_count():
    cfg = load_config(overrides=["model.name=vit_b16", "model.image_size=224", "model.num_classes=1000"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    assert n_params(model) == 86_567_656
    assert vit_complexity(cfg.model).params == 86_567_656


@pytest.mark.parametrize("stem", ["patchify", "conv"])
@pytest.mark.parametrize("classifier", ["token", "pooled"])
def test_layouts_give_identical_outputs_from_identical_weights(stem, classifier):
    base = load_config(overrides=[f"model.stem={stem}", f"model.classifier={classifier}"])
    first = build_model(base.model).eval()
    second = build_model(base.replace(["model.layout=batch_second"]).model).eval()
    torch.nn.init.normal_(first.head.weight)      # a zero head would hide differences
    second.load_state_dict(first.state_dict())
    images = torch.randn(3, 3, 32, 32)
    out = first(images)
    assert out.shape == (3, 10)
    torch.testing.assert_close(second(images), out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["batch_first", "batch_second"])
@pytest.mark.parametrize("classifier", ["token", "pooled"])
def test_tokens_enter_every_block_contiguous(layout, classifier):
    """Pooled (no class token to cat) once kept a strided view of the stem through every block."""
    model = build_model(load_config(overrides=[f"model.layout={layout}", f"model.classifier={classifier}"]).model)
    contiguous = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda m, args: contiguous.append(args[0].is_contiguous()))
    model(torch.randn(2, 3, 32, 32))
    assert contiguous == [True] * len(model.blocks)


def test_pooled_classifier_has_no_class_token_and_zero_head_init():
    token = build_model(load_config().model)
    pooled = build_model(load_config(overrides=["model.classifier=pooled"]).model)
    assert pooled.class_token is None and token.class_token is not None
    assert pooled.seq_len == token.seq_len - 1
    assert torch.count_nonzero(pooled.head.weight) == 0
    assert 0.005 < pooled.pos_embed.std().item() < 0.05


def test_batch_second_keeps_sequence_first_between_blocks():
    model = build_model(load_config(overrides=["model.layout=batch_second"]).model)
    shapes = []
    model.blocks[0].register_forward_hook(lambda m, i, o: shapes.append(o.shape))
    model(torch.randn(5, 3, 32, 32))
    assert shapes == [torch.Size([65, 5, 64])]


@pytest.mark.parametrize("overrides", [
    [],
    ["model.classifier=pooled"],
    ["model.stem=conv"],
    ["model.stem=conv", "model.classifier=pooled", "model.image_size=48"],
    ["model.name=vit_ti16", "model.image_size=224"],
    ["model.name=vit_ti16", "model.image_size=256", "model.stem=conv", "model.classifier=pooled"],
])
def test_flops_and_params_match_the_built_model(overrides):
    cfg = load_config(overrides=overrides)
    model = build_model(cfg.model)
    count = vit_complexity(cfg.model)
    assert count.params == n_params(model)
    with FlopCounterMode(display=False) as counter:
        model(torch.randn(1, 3, cfg.model.image_size, cfg.model.image_size))
    # FlopCounterMode counts 0 for CPU scaled_dot_product_attention: add its two matmuls per block.
    attention = cfg.model.depth * 2 * 2 * model.seq_len ** 2 * cfg.model.hidden_dim
    measured = counter.get_total_flops() + attention
    assert measured == pytest.approx(count.flops, rel=0.01)
    assert count.train_flops_per_image == 3 * count.flops


def test_flops_grow_with_image_size():
    small = vit_complexity(load_config(overrides=["model.name=vit_b16", "model.image_size=224"]).model)
    large = vit_complexity(load_config(overrides=["model.name=vit_b16", "model.image_size=256"]).model)
    assert small.flops == pytest.approx(35.13e9, rel=0.01)      # ViT-B/16: 17.6 GMACs at 224 px
    assert large.flops > small.flops * (256 / 224) ** 2


def test_position_embedding_shards_a_real_dimension_and_old_checkpoints_load():
    """pos_embed is (S, d) and the class token (d,): FSDP2 shards dim 0, which a leading 1 made N padded
    rows. A state dict written with the old (1, S, d) and (1, 1, d) shapes still loads, unchanged."""
    from rayvit.config import load_config
    from rayvit.models import build_model

    cfg = load_config(None, ["model.classifier=token"]).model
    model = build_model(cfg)
    s = (cfg.image_size // cfg.patch_size) ** 2 + 1
    assert tuple(model.pos_embed.shape) == (s, cfg.hidden_dim) and tuple(model.class_token.shape) == (cfg.hidden_dim,)
    old = {k: v.reshape(1, *v.shape) if k == "pos_embed" else v.reshape(1, 1, -1) if k == "class_token" else v
           for k, v in model.state_dict().items()}
    fresh = build_model(cfg)
    fresh.load_state_dict(old)
    assert torch.equal(fresh.pos_embed, model.pos_embed) and torch.equal(fresh.class_token, model.class_token)
