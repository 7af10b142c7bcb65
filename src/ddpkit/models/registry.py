"""The models ``ddpkit train --model`` names: the image classifiers of :mod:`ddpkit.models.vision` and the GPT of
:mod:`ddpkit.models.language`, built by :func:`build_model`."""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import nn

from ddpkit.models.language import GPT
from ddpkit.models.vision import MLP, ConvNet, ResNet

__all__ = ["LANGUAGE_MODELS", "MODELS", "build_model"]

MODELS: dict[str, Callable[..., nn.Module]] = {
    "convnet": ConvNet,
    "mlp": MLP,
    "resnet": ResNet,
    "gpt": GPT,  # 4 blocks of width 128: 0.8 M parameters
    "gpt-10m": functools.partial(GPT, layers=6, width=384, heads=6),  # 10.7 M
    "gpt-25m": functools.partial(GPT, layers=8, width=512, heads=8),  # 25.3 M
}
"""Model name -> builder; the names ``ddpkit train --model`` accepts."""
LANGUAGE_MODELS = ("gpt", "gpt-10m", "gpt-25m")
"""The models of :data:`MODELS` that read symbols (``vocab_size``, ``block_size``) rather than images."""


def build_model(name: str, **kwargs: object) -> nn.Module:
    """Build a model by name.

    Args:
        name: One of :data:`MODELS` (``convnet``, ``mlp``, ``resnet``, ``gpt``, ``gpt-10m``, ``gpt-25m``).
        **kwargs: Passed to the builder: ``in_channels``, ``num_classes``, ``image_size`` for the image models,
            ``vocab_size`` and ``block_size`` for the GPT.

    Raises:
        ValueError: ``name`` is not a known model.

    Example:
        >>> model = build_model("convnet")  # the tutorial's MNIST ConvNet
    """
    try:
        builder = MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}: choose one of {', '.join(sorted(MODELS))}"
        ) from None
    return builder(**kwargs)
