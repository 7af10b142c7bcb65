"""ddpkit.models: the registry and the tutorial's ConvNet."""

from __future__ import annotations

import pytest
import torch

from ddpkit.models import MODELS, build_model


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_maps_images_to_logits(name: str) -> None:
    assert build_model(name)(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    assert build_model(name, in_channels=3, image_size=16)(torch.randn(2, 3, 16, 16)).shape == (2, 10)


def test_convnet_is_the_tutorials() -> None:
    m = build_model("convnet")
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert shapes["layer1.0.weight"] == (16, 1, 5, 5) and shapes["layer1.1.running_mean"] == (16,)
    assert shapes["layer2.0.weight"] == (32, 16, 5, 5) and shapes["fc.weight"] == (10, 7 * 7 * 32)


def test_unknown_model() -> None:
    with pytest.raises(ValueError, match="unknown model 'vgg': choose one of convnet, mlp, resnet"):
        build_model("vgg")
