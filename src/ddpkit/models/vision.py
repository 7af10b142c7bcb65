"""The image classifiers ``ddpkit train`` offers (by name: :mod:`ddpkit.models.registry`).

* ``convnet``: the MNIST ConvNet of the distributed-training tutorial this
  project started from (conv 1->16 5x5 pad 2, BN, ReLU, max-pool 2; conv
  16->32 likewise; linear 7*7*32 -> 10 for 28x28 inputs).
* ``mlp``: flatten, two hidden layers with ReLU.
* ``resnet``: a small ResNet (three stages of basic blocks, 16/32/64 channels).

Every builder takes the same keywords: ``in_channels`` (1), ``num_classes``
(10) and ``image_size`` (28), so any of them runs on any image dataset.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ConvNet", "MLP", "ResNet"]


class ConvNet(nn.Module):
    """The tutorial's ConvNet: two conv/BN/ReLU/max-pool stages and a linear head.

    Args:
        in_channels: Input channels (1 for MNIST).
        num_classes: Output logits.
        image_size: Input height and width; the head sees ``(image_size // 4)**2 * 32``
            features (7*7*32 for 28x28).
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(
            nn.Conv2d(in_channels, 16, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.layer2 = nn.Sequential(
            nn.Conv2d(16, 32, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        side = image_size // 4
        self.fc = nn.Linear(side * side * 32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer2(self.layer1(x))
        return self.fc(out.reshape(out.size(0), -1))


class MLP(nn.Module):
    """A two-hidden-layer perceptron over the flattened image."""

    def __init__(
        self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28, hidden: int = 256
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_channels * image_size * image_size, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A small ResNet: a 3x3 stem, three stages of ``blocks`` basic blocks, global pooling.

    Args:
        in_channels: Input channels.
        num_classes: Output logits.
        image_size: Unused (global pooling makes the head size-independent); accepted
            so every model shares one signature.
        blocks: Basic blocks per stage (1 gives a ResNet-8).
        width: Channels of the first stage; doubled at each later stage.
    """

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        image_size: int = 28,
        blocks: int = 1,
        width: int = 16,
    ) -> None:
        super().__init__()
        del image_size
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
        )
        layers: list[nn.Module] = []
        cin = width
        for stage in range(3):
            cout = width * 2**stage
            for b in range(blocks):
                layers.append(_BasicBlock(cin, cout, stride=2 if (stage > 0 and b == 0) else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(out, 1), 1))
