"""The models the generated workloads are built from, as ``torch.nn`` modules with their
published configurations as defaults: only their parameters matter (they are built on the
``meta`` device and have no ``forward``), so each is the layout of its reference implementation.

The models whose tensors hold several matrices each are in :mod:`.mapped`, beside their groups.
"""

from __future__ import annotations

from torch import nn

from .mapped import attention_config


# ----- GPT-2 small and a Llama-style decoder --------------------------------------------------
class _GPT2Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn_qkv = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)


class GPT2(nn.Module):
    """GPT-2's parameters (Radford et al. 2019; the 124M "small" config by default), tied head."""

    def __init__(self, vocab=50257, context=1024, d=768, layers=12):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.h = nn.ModuleList(_GPT2Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight


class _GPT2Matrices(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.attn_qkv = nn.Linear(d, 3 * d, bias=False)
        self.attn_proj = nn.Linear(d, d, bias=False)
        self.mlp_fc = nn.Linear(d, 4 * d, bias=False)
        self.mlp_proj = nn.Linear(4 * d, d, bias=False)


class GPT2Blocks(nn.Module):
    """GPT-2 small's block matrices alone: per block qkv (2304×768), proj (768×768), fc
    (3072×768) and proj (768×3072), 48 matrices, 85M parameters. No norms, biases, embedding or
    head: every parameter is one the optimizer orthogonalises, as for ``torch.optim.Muon``."""

    def __init__(self, d=768, layers=12):
        super().__init__()
        self.h = nn.ModuleList(_GPT2Matrices(d) for _ in range(layers))


class _LlamaBlock(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, hidden: int, norms: bool = True):
        super().__init__()
        head_dim = d // heads
        self.head_dim, self.config = head_dim, attention_config(heads, kv_heads)  # as Transformers' layers
        if norms:
            self.input_norm = nn.RMSNorm(d)
        self.q_proj = nn.Linear(d, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, d, bias=False)
        if norms:
            self.post_norm = nn.RMSNorm(d)
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)


class Llama(nn.Module):
    """A Llama-style decoder; defaults are the public Llama 3.2 1B config (1.24B parameters)."""

    def __init__(self, vocab=128256, d=2048, layers=16, heads=32, kv_heads=8, hidden=8192, tied=True):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_LlamaBlock(d, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight


class LlamaLayers(nn.Module):
    """Decoder layers' matrices alone, by default 4 of Llama 3 8B's 32 (d 4096, 32 heads / 8 KV
    heads of 128, MLP 14336): per layer q, k, v, o, gate, up and down, 28 matrices, 872M
    parameters, 3.25 GiB in fp32. No norms, embedding or head: every parameter is one the
    optimizer orthogonalises, so a step is the matrix update alone."""

    def __init__(self, layers=4, d=4096, heads=32, kv_heads=8, hidden=14336):
        super().__init__()
        self.layers = nn.ModuleList(
            _LlamaBlock(d, heads, kv_heads, hidden, norms=False) for _ in range(layers)
        )


# ----- ResNet-50 ------------------------------------------------------------------------------
class _Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class ResNet50(nn.Module):
    """ResNet-50's parameters (He et al. 2016: bottlenecks [3, 4, 6, 3], 1000 classes): 25.6M."""

    def __init__(self, blocks=(3, 4, 6, 3), classes=1000):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)
        cin, stages = 64, []
        for i, n in enumerate(blocks):
            width = 64 * 2**i
            stage = []
            for j in range(n):
                stage.append(_Bottleneck(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = 4 * width
            stages.append(nn.Sequential(*stage))
        self.layers = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, classes)
