"""The two small models trained from scratch: a CNN for digits, a character-level transformer.

Both are plain ``nn`` modules written for this comparison: they hold every kind of parameter an
optimizer meets in practice (conv kernels, linear matrices, embeddings, norms, biases, an output
head) so that ``fastmuon.param_groups`` has real decisions to make.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class DigitsCNN(nn.Module):
    """Three 3×3 conv blocks (conv, BatchNorm, ReLU) and a two-layer classifier for 8×8 images."""

    def __init__(self, width: int = 32, hidden: int = 128, classes: int = 10):
        super().__init__()

        def block(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

        self.features = nn.Sequential(
            *block(1, width),
            *block(width, width),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
            *block(width, 2 * width),
            nn.MaxPool2d(2),  # 4x4 -> 2x2
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * width * 4, hidden), nn.ReLU(), nn.Linear(hidden, classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} must be divisible by heads={heads}")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(LN(x))`` then ``x + MLP(LN(x))``."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    """A small GPT-style next-character model: token + position embeddings, blocks, LN, head.

    The output layer is named ``head``, so ``param_groups`` keeps it (like the embeddings) out
    of the Muon group.
    """

    def __init__(self, vocab_size: int, block: int = 64, dim: int = 128, layers: int = 2, heads: int = 4):
        super().__init__()
        self.block = block
        self.tok_emb = nn.Embedding(vocab_size, dim)
        self.pos_emb = nn.Embedding(block, dim)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.block:
            raise ValueError(f"sequence of {t} tokens is longer than the model's block={self.block}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))
