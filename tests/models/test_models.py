"""ddpkit.models: the registry, the tutorial's ConvNet and the GPT."""

from __future__ import annotations

import pytest
import torch

from ddpkit.models import GPT, MODELS, build_model
from ddpkit.models.registry import LANGUAGE_MODELS


@pytest.mark.parametrize("name", sorted(set(MODELS) - set(LANGUAGE_MODELS)))
def test_every_image_model_maps_images_to_logits(name: str) -> None:
    assert build_model(name)(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    assert build_model(name, in_channels=3, image_size=16)(torch.randn(2, 3, 16, 16)).shape == (2, 10)


def test_convnet_is_the_tutorials() -> None:
    m = build_model("convnet")
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert shapes["layer1.0.weight"] == (16, 1, 5, 5) and shapes["layer1.1.running_mean"] == (16,)
    assert shapes["layer2.0.weight"] == (32, 16, 5, 5) and shapes["fc.weight"] == (10, 7 * 7 * 32)


def test_unknown_model() -> None:
    with pytest.raises(ValueError, match="unknown model 'vgg': choose one of convnet, gpt, gpt-10m, gpt-25m, mlp, resnet"):
        build_model("vgg")


def test_the_gpt_is_causal_tied_and_refuses_a_context_too_long() -> None:
    torch.manual_seed(0)
    gpt = build_model("gpt", vocab_size=11, block_size=8)
    assert isinstance(gpt, GPT) and gpt.head.weight is gpt.tokens.weight
    x = torch.randint(0, 11, (3, 8))
    out = gpt(x)
    assert out.shape == (3, 8, 11)
    changed = x.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 11
    torch.testing.assert_close(gpt(changed)[:, :5], out[:, :5])  # no symbol sees the ones after it
    assert not torch.allclose(gpt(changed)[:, 5:], out[:, 5:])
    assert gpt(x[:, :3]).shape == (3, 3, 11)
    with pytest.raises(ValueError, match="a sequence of 9 symbols is longer than block_size=8"):
        gpt(torch.zeros(1, 9, dtype=torch.long))
    assert abs(sum(p.numel() for p in GPT().parameters()) - 0.81e6) < 0.01e6
    assert abs(sum(p.numel() for p in GPT(layers=8, width=512, heads=8).parameters()) - 25.3e6) < 0.1e6
    for name, size in (("gpt-10m", 10.7e6), ("gpt-25m", 25.3e6)):  # the sizes ddpkit train --model names
        assert abs(sum(p.numel() for p in build_model(name, vocab_size=65, block_size=64).parameters()) - size) < 0.1e6
