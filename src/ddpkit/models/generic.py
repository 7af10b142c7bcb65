"""Models the benchmarks time besides the image classifiers: a transformer encoder and a deep linear stack."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["DeepLinear", "TransformerClassifier"]


class TransformerClassifier(nn.Module):
    """Encoder layers, the mean over tokens, and a linear head (``ddpkit bench``'s ``transformer``).

    Args:
        d_model: width of the tokens (inputs are ``batch x tokens x d_model``).
        layers: encoder layers (8 heads, feed-forward ``4 * d_model``, no dropout).
        num_classes: output logits.
    """

    def __init__(self, d_model: int = 256, layers: int = 6, num_classes: int = 10) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, nhead=8, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(dim=1))


class DeepLinear(nn.Sequential):
    """``depth`` ``Linear(width, width)`` layers with tanh between them (``ddpkit bench``'s ``linear200``).

    Many tiny parameters: a step is dominated by what an engine does per parameter.
    """

    def __init__(self, depth: int = 200, width: int = 16) -> None:
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.Tanh()]
        super().__init__(*layers)
