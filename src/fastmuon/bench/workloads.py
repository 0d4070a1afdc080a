"""The workloads ``fastmuon bench --model`` knows by name.

The yolo26 manifests are shipped as JSON (their real shapes and the groups Ultralytics' trainer
builds). The transformer and ResNet workloads are generated here from their published
configurations: the model is built from ``torch.nn`` modules on the ``meta`` device (no memory,
no weights) and grouped with :func:`fastmuon.param_groups`, exactly as a user would; the ones
whose tensors hold several matrices (:mod:`.mapped`) with their groups and matrix maps written out.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from ..groups.build import param_groups
from .manifest import Manifest, ManifestError, load_manifest, manifest_from_dict, manifest_from_module
from .mapped import (
    GPT2Conv1D,
    attention_config,
    gpt2_conv1d_groups,
    gpt_oss_like_decoder,
    gpt_oss_like_groups,
    moe_decoder,
    moe_groups,
)

YOLO_MODELS = ("yolo26n", "yolo26s", "yolo26m", "yolo26l", "yolo26x")

# Hyperparameters for the generated workloads: the Muon group at the usual Muon settings, the
# rest at an AdamW-like learning rate (MuSGD steps them with SGD momentum at the same values).
MATRIX_GROUP = {"lr": 0.02, "momentum": 0.95, "nesterov": True, "weight_decay": 0.01}
OTHER_GROUP = {"lr": 3e-4, "momentum": 0.95, "nesterov": True, "weight_decay": 0.0}


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


class _LlamaBlock(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        head_dim = d // heads
        self.head_dim, self.config = head_dim, attention_config(heads, kv_heads)  # as Transformers' layers
        self.input_norm = nn.RMSNorm(d)
        self.q_proj = nn.Linear(d, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, d, bias=False)
        self.post_norm = nn.RMSNorm(d)
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)


class _Llama(nn.Module):
    """A Llama-style decoder; defaults are the public Llama 3.2 1B config (1.24B parameters)."""

    def __init__(self, vocab=128256, d=2048, layers=16, heads=32, kv_heads=8, hidden=8192, tied=True):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_LlamaBlock(d, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight


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


class _ResNet(nn.Module):
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


class Generated(NamedTuple):
    """A workload built from code: the model (on the meta device), what config it follows, and
    how its parameters are grouped (the hyperparameters are set by :func:`generated_manifest`)."""

    build: Callable[[], nn.Module]
    source: str
    # takes the model ``build`` returns (each grouping is written for its own model class)
    grouping: Callable[[Any], list[dict[str, Any]]] = param_groups
    grouping_note: str = "groups: fastmuon.param_groups"


_WRITTEN_OUT = "groups and matrix maps written out (fastmuon.bench.mapped)"

#: name -> how the workload is built
GENERATED: dict[str, Generated] = {
    "gpt2": Generated(GPT2, "GPT-2 small (124M): vocab 50257, context 1024, d 768, 12 layers, tied head"),
    "gpt2-split": Generated(
        GPT2Conv1D,
        "GPT-2 small (124M) as its reference code stores it: Conv1D weights (in, out), each mapped "
        "'transposed'; c_attn (768, 2304) mapped {split: [768, 768, 768], transposed}, so q, k and v "
        "are orthogonalised as three matrices",
        gpt2_conv1d_groups,
        _WRITTEN_OUT,
    ),
    "granite-moe": Generated(
        moe_decoder,
        "granite-3.0-1b-a400m config (ibm-granite/granite-3.0-1b-a400m-base: vocab 49152, d 1024, "
        "16 heads / 8 KV heads, 32 experts of FFN 512, tied) with 1 of its 24 decoder layers; experts "
        "fused as Transformers 5.x stores them: gate_up_proj (32, 1024, 1024) mapped {batch_dims: 1, "
        "split: [512, 512]} and down_proj (32, 1024, 512) mapped 'experts'; router (32, 1024) and "
        "attention q/k/v/o as plain matrices",
        moe_groups,
        _WRITTEN_OUT,
    ),
    "gpt-oss-like": Generated(
        gpt_oss_like_decoder,
        "granite-moe's decoder layer (the same widths and matrices) with its experts laid out as "
        "GPT-OSS lays them out (Transformers' GptOssExperts): gate_up_proj (32, 1024, 1024) stored "
        "(in, out) with gate and up columns interleaved, mapped {batch_dims: 1, split: [512, 512], "
        "interleaved, transposed}, so each expert's gate and up are strided views; down_proj "
        "(32, 512, 1024) mapped {batch_dims: 1, transposed}; the experts' biases take the "
        "elementwise update",
        gpt_oss_like_groups,
        _WRITTEN_OUT,
    ),
    "llama-1b": Generated(
        _Llama,
        "Llama 3.2 1B config: vocab 128256, d 2048, 16 layers, 32 heads / 8 KV heads, MLP 8192, tied",
    ),
    "resnet50": Generated(_ResNet, "ResNet-50: bottlenecks [3, 4, 6, 3], 1000 classes (He et al. 2016)"),
}

WORKLOADS = (*YOLO_MODELS, *GENERATED)


def generated_manifest(name: str) -> Manifest:
    return manifest_of(GENERATED[name], name)


def manifest_of(workload: Generated, name: str) -> Manifest:
    """``workload``'s manifest: its model built on the meta device and grouped, at the usual
    Muon hyperparameters for the matrices and an AdamW-like learning rate for the rest."""
    with torch.device("meta"):
        model = workload.build()
    groups = [{**g, **(MATRIX_GROUP if g["use_muon"] else OTHER_GROUP)} for g in workload.grouping(model)]
    source = f"{workload.source}; {workload.grouping_note}"
    return manifest_from_module(model, groups, name=name, source=source)


def bundled_manifest(name: str) -> Manifest:
    text = resources.files("fastmuon").joinpath(f"models/{name}.json").read_text()
    import json

    return manifest_from_dict(json.loads(text), where=f"fastmuon/models/{name}.json")


def resolve_workload(model: str) -> Manifest:
    """A workload by name (see :data:`WORKLOADS`) or a path to a manifest ``.json``."""
    if model in YOLO_MODELS:
        return bundled_manifest(model)
    if model in GENERATED:
        return generated_manifest(model)
    if model.endswith(".json") or Path(model).exists():
        return load_manifest(model)
    raise ManifestError(
        f"unknown workload {model!r}: choose one of {', '.join(WORKLOADS)} or give a manifest .json path "
        "(make one from your model with fastmuon.bench.manifest_from_module(model).save('m.json'))"
    )
