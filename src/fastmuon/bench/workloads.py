"""Every workload the bench knows by name, and where each comes from.

- :data:`YOLO_MODELS`: manifests shipped as JSON in ``fastmuon/models/`` (their real shapes and
  the groups Ultralytics' trainer builds).
- :data:`GENERATED`: the transformer and ResNet workloads, generated from their published
  configurations: the model (:mod:`.models`, or :mod:`.mapped` for those whose tensors hold
  several matrices) is built from ``torch.nn`` modules on the ``meta`` device (no memory, no
  weights) and grouped with :func:`fastmuon.param_groups`, exactly as a user would, or with its
  groups and matrix maps written out (:mod:`.mapped`).
- :func:`quick_manifests`: toy-size stand-ins of two of them, which
  ``python -m fastmuon.bench.gpucheck --quick`` writes out and benches by path.

``fastmuon bench --model`` takes any of :data:`WORKLOADS` or a manifest's path.
"""

from __future__ import annotations

import functools
import json
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
    gpt2_conv1d_groups,
    gpt_oss_like_decoder,
    gpt_oss_like_groups,
    moe_decoder,
    moe_groups,
)
from .models import GPT2, GPT2Blocks, Llama, LlamaLayers, ResNet50

YOLO_MODELS = ("yolo26n", "yolo26s", "yolo26m", "yolo26l", "yolo26x")

# Hyperparameters for the generated workloads: the Muon group at the usual Muon settings, the
# rest at an AdamW-like learning rate (MuSGD steps them with SGD momentum at the same values).
MATRIX_GROUP = {"lr": 0.02, "momentum": 0.95, "nesterov": True, "weight_decay": 0.01}
OTHER_GROUP = {"lr": 3e-4, "momentum": 0.95, "nesterov": True, "weight_decay": 0.0}


class Generated(NamedTuple):
    """A workload built from code: the model (on the meta device), what config it follows, and
    how its parameters are grouped (the hyperparameters are set by :func:`generated_manifest`)."""

    build: Callable[[], nn.Module]
    source: str
    # takes the model ``build`` returns (each grouping is written for its own model class)
    grouping: Callable[[Any], list[dict[str, Any]]] = param_groups
    grouping_note: str = "groups: fastmuon.param_groups"
    #: why it is not stepped on a CPU ("" where it is): a step there would take minutes
    gpu_only: str = ""


_WRITTEN_OUT = "groups and matrix maps written out (fastmuon.bench.mapped)"

#: name -> how the workload is built
GENERATED: dict[str, Generated] = {
    "gpt2": Generated(GPT2, "GPT-2 small (124M): vocab 50257, context 1024, d 768, 12 layers, tied head"),
    "gpt2-blocks": Generated(
        GPT2Blocks,
        "GPT-2 small's 12 blocks' weight matrices alone (d 768: qkv, attention projection, MLP in "
        "and out per block), 48 matrices, 85M parameters; no norms, biases, embedding or head",
        functools.partial(param_groups, head=None),
        "groups: fastmuon.param_groups(model, head=None)",
    ),
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
        Llama,
        "Llama 3.2 1B config: vocab 128256, d 2048, 16 layers, 32 heads / 8 KV heads, MLP 8192, tied",
    ),
    "llama-8b-layers": Generated(
        LlamaLayers,
        "Llama 3 8B's decoder-layer matrices (d 4096, 32 heads / 8 KV heads of 128, MLP 14336), "
        "4 of its 32 layers: q, k, v, o, gate, up, down per layer, 28 fp32 matrices (3.25 GiB); "
        "no norms, embedding or head",
        functools.partial(param_groups, head=None),
        "groups: fastmuon.param_groups(model, head=None)",
        gpu_only="a step of Newton–Schulz on its 28 matrices of up to 14336x4096 takes minutes on a CPU: run it with --device cuda (traced on fake cuda tensors where there is no GPU, or timed on one)",
    ),
    "resnet50": Generated(ResNet50, "ResNet-50: bottlenecks [3, 4, 6, 3], 1000 classes (He et al. 2016)"),
}

WORKLOADS = (*YOLO_MODELS, *GENERATED)


def gpu_only_problem(model: str, device: str) -> str | None:
    """Why workload ``model`` is not run on ``device`` (None: it is)."""
    workload = GENERATED.get(model)
    if workload is None or not workload.gpu_only or device != "cpu":
        return None
    return f"--model {model} is meant for a GPU: {workload.gpu_only}"


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


def bundled_data(name: str) -> dict[str, Any]:
    """The shipped manifest ``name`` (one of :data:`YOLO_MODELS`) as its JSON reads."""
    if name not in YOLO_MODELS:
        raise ValueError(f"unknown model {name!r}; bundled manifests: {', '.join(YOLO_MODELS)}")
    data: dict[str, Any] = json.loads(resources.files("fastmuon").joinpath(f"models/{name}.json").read_text())
    return data


def bundled_manifest(name: str) -> Manifest:
    return manifest_from_dict(bundled_data(name), where=f"fastmuon/models/{name}.json")


def quick_manifests() -> dict[str, Manifest]:
    """``name -> manifest`` of the toy-size stand-ins: yolo26n's first 60 tensors (its groups and
    hyperparameters), and GPT-2's layout with two 128-wide blocks and a 512-token vocabulary."""
    yolo = bundled_data("yolo26n")
    yolo.update(model="yolo26n-quick", params=yolo["params"][:60])
    gpt2 = Generated(
        functools.partial(GPT2, vocab=512, context=64, d=128, layers=2), "GPT-2 layout, 2 blocks of width 128"
    )
    return {
        "yolo26n-quick": manifest_from_dict(yolo, where="yolo26n's first 60 tensors"),
        "gpt2-quick": manifest_of(gpt2, "gpt2-quick"),
    }


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
