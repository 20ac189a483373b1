"""The CNN baseline: a small CIFAR-style ResNet (He et al. 2016) with GroupNorm, a model like the ViT.

    stem      3x3 conv, GroupNorm, ReLU                              (B, H, W, C) -> (B, H, W, w0)
    stages    BasicBlocks (minivit/conv.py); each stage after the first halves H and W
    pool      global average pooling                                 (B, H', W', w_last) -> (B, w_last)
    head      linear classifier                                      (B, K)

It is the CNN of the data-size experiment (experiments/data_size.py, notebook 11): the paper's BiT
ResNets use GroupNorm too, with weight standardisation, which is left out here. The forward, backward,
state_dict and loading come from model.Classifier, as the ViT's do.
"""

import dataclasses
from dataclasses import dataclass

from .backend import backend_of, host_rng, is_array
from .conv import BasicBlock, ConvNormAct, GlobalAvgPool, conv_output_size
from .layers import Linear
from .model import DTYPES, Classifier


@dataclass(frozen=True)
class ResNetConfig:
    """The shape of the baseline ResNet. The default is a ResNet-8-like net for 32x32 images."""

    img_size: tuple = (32, 32)     # (H, W): only for the FLOP count; the net takes any size (it ends in GAP)
    in_chans: int = 3              # C
    num_classes: int = 10          # K
    widths: tuple = (16, 32, 64)   # channels of each stage; stages after the first halve H and W
    depths: tuple = (1, 1, 1)      # BasicBlocks per stage (ResNet-20 on CIFAR: (3, 3, 3))

    def __post_init__(self):
        img = self.img_size
        if isinstance(img, int) and not isinstance(img, bool):
            img = (img, img)
        if not (isinstance(img, (tuple, list)) and len(img) == 2 and all(isinstance(v, int) and v > 0 for v in img)):
            raise ValueError(f"img_size must be an int or a pair (H, W) of positive ints, got {self.img_size!r}")
        object.__setattr__(self, "img_size", tuple(img))
        for name in ("in_chans", "num_classes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("widths", "depths"):
            value = getattr(self, name)
            if (not isinstance(value, (tuple, list)) or not value
                    or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
                raise ValueError(f"{name} must be a non-empty tuple of positive ints, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        if len(self.widths) != len(self.depths):
            raise ValueError(f"widths {self.widths} and depths {self.depths} must have one entry per stage")

    def blocks(self):
        """(in_chans, out_chans, stride) of every BasicBlock, in order."""
        out, c_in = [], self.widths[0]
        for s, (width, depth) in enumerate(zip(self.widths, self.depths)):
            for b in range(depth):
                out.append((c_in, width, 2 if s > 0 and b == 0 else 1))
                c_in = width
        return out

    def num_params(self):
        """The parameter count from the shapes alone (convs have no bias; each GroupNorm has 2 C)."""
        C, w0, K = self.in_chans, self.widths[0], self.num_classes
        total = 9 * C * w0 + 2 * w0                                     # stem conv + norm
        for c_in, c_out, stride in self.blocks():
            total += 9 * c_in * c_out + 2 * c_out + 9 * c_out * c_out + 2 * c_out   # conv1, norm1, conv2, norm2
            if stride != 1 or c_in != c_out:
                total += c_in * c_out + 2 * c_out                       # shortcut 1x1 conv + norm
        return total + self.widths[-1] * K + K                          # head

    def flops(self):
        """FLOPs of one image's forward at img_size through every convolution and the head, a multiply-add
        counted as 2 (norms, ReLUs and the pooling left out, as minivit.flops does for the ViT)."""
        H, W = self.img_size
        total = 2 * H * W * 9 * self.in_chans * self.widths[0]                    # stem
        for c_in, c_out, stride in self.blocks():
            H, W = conv_output_size(H, 3, stride, 1), conv_output_size(W, 3, stride, 1)
            total += 2 * H * W * 9 * (c_in * c_out + c_out * c_out)               # conv1, conv2
            if stride != 1 or c_in != c_out:
                total += 2 * H * W * c_in * c_out                                  # 1x1 shortcut
        return total + 2 * self.widths[-1] * self.num_classes                    # head

    def to_dict(self):
        d = dataclasses.asdict(self)
        d.update(img_size=list(self.img_size), widths=list(self.widths), depths=list(self.depths))
        return d


class ResNet(Classifier):
    """The CNN baseline: stem (3x3 conv, norm, ReLU) -> stages of BasicBlocks -> GAP -> linear head.
    ``forward(x)`` maps images (B, H, W, C) to logits (B, K); ``backward(dlogits)`` returns dx."""

    def __init__(self, config, seed=0, dtype="float32"):
        super().__init__()
        if not isinstance(config, ResNetConfig):
            raise TypeError(f"config must be a ResNetConfig, got {type(config).__name__}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        self.config, self.dtype, self.seed = config, dtype, seed
        c = config
        rng = host_rng(seed)
        self.stem = ConvNormAct(c.in_chans, c.widths[0], 3, 1, rng=rng, dtype=dtype)
        names = [f"stages.{s}.{b}" for s, depth in enumerate(c.depths) for b in range(depth)]
        for name, (c_in, c_out, stride) in zip(names, c.blocks()):
            self.add(name, BasicBlock(c_in, c_out, stride, rng=rng, dtype=dtype))
        self.pool = GlobalAvgPool()
        self.head = Linear(c.widths[-1], c.num_classes, rng=rng, dtype=dtype)

    def stages(self):
        """(name, layer) in forward order, as registered now; backward runs them in reverse."""
        return list(self.children.items())

    def check_input(self, x):
        C = self.config.in_chans
        if not is_array(x):
            raise TypeError(f"expected an image batch as a numpy or cupy array (B, H, W, {C}), got {type(x).__name__}")
        if backend_of(x) != self.backend:
            raise TypeError(f"the input is a {backend_of(x)} array but the model lives on {self.backend}")
        if x.ndim != 4 or x.shape[3] != C:
            raise ValueError(f"expected a channels-last image batch (B, H, W, {C}), got shape {tuple(x.shape)}")
        if x.dtype != self.dtype:
            raise TypeError(f"the input is {x.dtype} but the model is {self.dtype}: use x.astype('{self.dtype}')")

    def extra_repr(self):
        c = self.config
        return f"widths={c.widths}, depths={c.depths}, num_classes={c.num_classes}, params={self.num_params():,}"


resnet_presets = {
    # 78k parameters, 25 MFLOPs per 32x32x3 image (forward): about the 64-wide, 4-block ViT of the quick
    # experiments (22 MFLOPs at 32x32, patch 4)
    "resnet8_gn": ResNetConfig(widths=(16, 32, 64), depths=(1, 1, 1)),
    # ResNet-20 of He et al. §4.2 (0.27M parameters), with GroupNorm in place of BatchNorm
    "resnet20_gn": ResNetConfig(widths=(16, 32, 64), depths=(3, 3, 3)),
    # wider, for the GPU runs on CIFAR-10: 0.70M parameters, 211 MFLOPs (vit_cifar_tiny: 1.8M, 251 MFLOPs)
    "resnet14_gn_wide": ResNetConfig(widths=(32, 64, 128), depths=(2, 2, 2)),
}
