"""The built-in models, used by ``ddpkit train`` and ``ddpkit bench`` alike.

:mod:`ddpkit.models.vision` holds the image classifiers ``ddpkit train``
offers by name (the tutorial's ConvNet, an MLP, a small ResNet),
:mod:`ddpkit.models.language` its GPT (``--model gpt``), :mod:`ddpkit.models.registry` the names;
:mod:`ddpkit.models.generic` the other models the benchmarks time (a
transformer encoder, a deep stack of tiny linear layers).
"""

from ddpkit.models.generic import DeepLinear, TransformerClassifier
from ddpkit.models.language import GPT
from ddpkit.models.registry import MODELS, build_model
from ddpkit.models.vision import MLP, ConvNet, ResNet

__all__ = ["GPT", "MLP", "MODELS", "ConvNet", "DeepLinear", "ResNet", "TransformerClassifier", "build_model"]
