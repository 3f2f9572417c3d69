"""MUSK's vision path in plain torch, in the key layout of the released file, so that neither
MUSK's package (its vendored torchscale, which imports fairscale) nor TRIDENT is needed.

MUSK (``xiangjx/musk`` ``model.safetensors``, lilab-stanford/MUSK ``musk/modeling.py``) is a
BEiT-3: a multiway transformer whose every linear and norm has a vision copy (``A``) and a
text copy (``B``). An image alone runs through the ``A`` copies only (torchscale's
``MultiwayNetwork`` with ``split_position == -1``), so this module holds those under the same
names (``beit3.encoder.layers.N.self_attn.q_proj.A.weight``...) and the recipe leaves the
text copies, the text embedding and the contrastive heads of the file out.

Torchscale's encoder as MUSK configures it (``_get_large_config``): pre-norm layers with
sub-LayerNorms (``subln``: a norm before the attention's output projection and inside the
feed-forward), exact GELU, no embedding scale, learned positions starting at index 2
(fairseq's convention), a final LayerNorm, no relative position bias.

The features are the model card's for linear probes and MIL (MUSK's README): ``model(image=x,
with_head=False, out_norm=False, ms_aug=True, return_global=True)[0]``, the class token at
384 px concatenated with the mean class token of the four 384 px quarters of the tile
upscaled to 768 px (``MultiScaleForward``, scales 1 and 2): 2,048 wide. TRIDENT's default
(``inference_aug=False``) is the first half, the class token at 384 px.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

WIDTH = 1024
HEADS = 16
DEPTH = 24
FFN = 4096
PATCH = 16
EPS = 1e-5
POSITION_OFFSET = 2  # fairseq's positions start at 2 (MUSK's BEiT3 and PositionalEmbedding)


class VisionWay(nn.Module):
    """The vision copy (``A``) of a torchscale multiway module: the key names say ``.A.``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.A = module  # the file's key name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.A(x)  # type: ignore[no-any-return]


class SelfAttention(nn.Module):
    """Torchscale's ``MultiheadAttention`` with its sub-LayerNorm (``inner_attn_ln``)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = VisionWay(nn.Linear(WIDTH, WIDTH))
        self.k_proj = VisionWay(nn.Linear(WIDTH, WIDTH))
        self.v_proj = VisionWay(nn.Linear(WIDTH, WIDTH))
        self.out_proj = VisionWay(nn.Linear(WIDTH, WIDTH))
        self.inner_attn_ln = VisionWay(nn.LayerNorm(WIDTH, eps=EPS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(*t.shape[:-1], HEADS, -1).transpose(1, 2)

        q, k, v = (heads(proj(x)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return self.out_proj(self.inner_attn_ln(out))  # type: ignore[no-any-return]


class FeedForward(nn.Module):
    """Torchscale's ``FeedForwardNetwork``: GELU (in float32) and a sub-LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, FFN)
        self.fc2 = nn.Linear(FFN, WIDTH)
        self.ffn_layernorm = nn.LayerNorm(FFN, eps=EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc1(x)
        hidden = F.gelu(hidden.float()).type_as(hidden)
        return self.fc2(self.ffn_layernorm(hidden))  # type: ignore[no-any-return]


class Layer(nn.Module):
    """A pre-norm encoder layer (torchscale's ``EncoderLayer``, no deepnorm: residual x 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.self_attn = SelfAttention()
        self.self_attn_layer_norm = VisionWay(nn.LayerNorm(WIDTH, eps=EPS))
        self.ffn = VisionWay(FeedForward())
        self.final_layer_norm = VisionWay(nn.LayerNorm(WIDTH, eps=EPS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.ffn(self.final_layer_norm(x))  # type: ignore[no-any-return]


class Encoder(nn.Module):
    """Torchscale's ``Encoder`` on vision tokens: positions, layers, final LayerNorm."""

    def __init__(self, tokens: int) -> None:
        super().__init__()
        self.embed_positions = VisionWay(nn.Embedding(tokens + POSITION_OFFSET, WIDTH))
        self.layers = nn.ModuleList(Layer() for _ in range(DEPTH))
        self.layer_norm = VisionWay(nn.LayerNorm(WIDTH, eps=EPS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = self.embed_positions.get_parameter("A.weight")
        x = x + positions[POSITION_OFFSET : POSITION_OFFSET + x.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)  # type: ignore[no-any-return]


class VisionEmbedding(nn.Module):
    """Patch embedding with a class token (torchscale's ``VisionEmbedding``; its mask token
    is for masked pretraining and is left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, WIDTH, kernel_size=PATCH, stride=PATCH)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x).flatten(2).transpose(1, 2)
        return torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)


class BEiT3Vision(nn.Module):
    """``beit3`` of the file: image -> normalized tokens (class token first)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self.vision_embed = VisionEmbedding()
        self.encoder = Encoder((size // PATCH) ** 2 + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[-2:]) != (self.size, self.size):
            # torchscale asserts the same: the positions are those of one grid
            raise ValueError(f"MUSK takes {self.size} px inputs, not {tuple(x.shape[-2:])}")
        return self.encoder(self.vision_embed(x))  # type: ignore[no-any-return]


class MuskVision(nn.Module):
    """MUSK's multi-scale vision features (the card's ``ms_aug=True``): (B, 2 x 1024)."""

    def __init__(self, size: int = 384) -> None:
        super().__init__()
        self.beit3 = BEiT3Vision(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = self.beit3.size
        batch = x.shape[0]
        # MultiScaleForward: the input as it is (resized to itself, as MUSK does), then
        # upscaled x2 and cut into 2 x 2 quarters of the input's size (split_chessboard)
        same = F.interpolate(x.float(), size=size, mode="bicubic").to(x.dtype)
        big = F.interpolate(x.float(), size=2 * size, mode="bicubic").to(x.dtype)
        quarters = big.reshape(batch, -1, 2, size, 2, size)  # b c nh h nw w
        quarters = quarters.permute(2, 4, 0, 1, 3, 5).reshape(4 * batch, -1, size, size)
        whole = self.beit3(same)[:, 0]
        parts = self.beit3(quarters)[:, 0].reshape(4, batch, -1).mean(0)
        return torch.cat([whole, parts], dim=-1)
