"""ResNet-50 (He et al. 2015, "Deep Residual Learning"), the bottleneck variant, as a plain
``nn.Module`` that follows the pipeline contract (docs/architecture.md#contracts).

``pipeline_layers()`` is ``[stem, layer1, layer2, layer3, layer4, head]``: the stem
(7×7 conv, BN, ReLU, max-pool), the four groups of bottleneck blocks (3, 4, 6, 3 blocks) and the
head (global average pool, flatten, fully connected); each maps one tensor to one tensor, and
their composition is ``forward``. Parameter names follow torchvision's ``resnet50`` under the
``stem.`` / ``head.`` prefixes (torchvision's v1.5 layout: the stride sits on the 3×3 conv), so
the parameter count is torchvision's 25,557,032 for 1000 classes.
"""

from __future__ import annotations

from torch import Tensor, nn


class Bottleneck(nn.Module):
    """1×1 reduce → 3×3 (strided) → 1×1 expand (×4), plus the shortcut, then ReLU."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class Stem(nn.Module):
    def __init__(self, in_channels: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.maxpool(self.relu(self.bn1(self.conv1(x))))


class Head(nn.Module):
    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_features, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.avgpool(x).flatten(1))


def _group(in_channels: int, width: int, blocks: int, stride: int) -> nn.Sequential:
    layers = [Bottleneck(in_channels, width, stride)]
    layers += [Bottleneck(width * Bottleneck.expansion, width) for _ in range(blocks - 1)]
    return nn.Sequential(*layers)


class ResNet50(nn.Module):
    """ResNet-50 for ``num_classes`` classes; ``forward(images (B, C, H, W)) -> logits``."""

    def __init__(self, num_classes: int = 1000, in_channels: int = 3) -> None:
        super().__init__()
        if not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
        self.stem = Stem(in_channels)
        self.layer1 = _group(64, 64, 3, stride=1)
        self.layer2 = _group(256, 128, 4, stride=2)
        self.layer3 = _group(512, 256, 6, stride=2)
        self.layer4 = _group(1024, 512, 3, stride=2)
        self.head = Head(512 * Bottleneck.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        # Zero the last BN of each residual branch (Goyal et al. 2017): each block starts as
        # the identity, which makes early training of deep ResNets markedly more stable.
        for m in self.modules():
            if isinstance(m, Bottleneck):
                nn.init.zeros_(m.bn3.weight)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    def repeated_blocks(self) -> list[nn.Module]:
        """The 16 bottleneck blocks (as their groups hold them): what activation checkpointing
        wraps."""
        return [block for group in self.pipeline_layers()[1:-1] for block in group]

    def pipeline_layers(self) -> list[nn.Module]:
        """``[stem, layer1, layer2, layer3, layer4, head]``, in forward order."""
        return [self.stem, self.layer1, self.layer2, self.layer3, self.layer4, self.head]
