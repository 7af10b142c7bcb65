"""The models ``ddpkit train --model`` names: the image classifiers of :mod:`ddpkit.models.vision` and the GPT of
:mod:`ddpkit.models.language`, built by :func:`build_model`."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ddpkit.models.language import GPT
from ddpkit.models.vision import MLP, ConvNet, ResNet

__all__ = ["LANGUAGE_MODELS", "MODELS", "build_model"]

MODELS: dict[str, Callable[..., nn.Module]] = {
    "convnet": ConvNet,
    "mlp": MLP,
    "resnet": ResNet,
    "gpt": GPT,
}
"""Model name -> builder; the names ``ddpkit train --model`` accepts."""
LANGUAGE_MODELS = ("gpt",)
"""The models of :data:`MODELS` that read symbols (``vocab_size``, ``block_size``) rather than images."""


def build_model(name: str, **kwargs: object) -> nn.Module:
    """Build a model by name.

    Args:
        name: One of :data:`MODELS` (``convnet``, ``mlp``, ``resnet``, ``gpt``).
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
