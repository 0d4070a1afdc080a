"""Workload manifests: a model's parameter shapes and groups without its weights; synthetic tensors from them.

A manifest is JSON::

    {"model": "yolo26n", "source": "where the shapes came from",
     "optimizer_kwargs": {"muon": 0.2, "sgd": 1.0},
     "param_groups": [{"lr": 0.01, "momentum": 0.937, "use_muon": true, ...}, ...],
     "params": [{"name": "model.0.conv.weight", "shape": [16, 3, 3, 3], "group": 1}, ...]}

It is all a benchmark needs to recreate an optimizer's work on a model (same tensors, same
groups), and small enough to ship for models whose code we do not want to depend on. A group
may carry the optimizers' ``"matrices"`` key (see :mod:`fastmuon.ns.matrices`): one map for its
parameters, or a list with one per parameter, in the order they appear in ``params``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..ns.matrices import MatrixMap, MatrixMapSpec, maps_of, parse
from ..ns.matrices import count as matrix_count

#: Group keys that hold tensors or names, never hyperparameters.
_NON_HYPER_KEYS = ("params", "param_names")


class ManifestError(ValueError):
    """A manifest that cannot be used; the message names the file and the entry."""


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    group: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Manifest:
    model: str
    params: list[ParamSpec]
    param_groups: list[dict[str, Any]]
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def matrices(self, use_muon_default: bool = True) -> list[ParamSpec]:
        """Parameters an optimizer would orthogonalise: >=2D ones in groups that do not opt out."""
        return [p for p in self.params if _orthogonalised(p, self.param_groups, use_muon_default)]

    def map_specs(self) -> list[MatrixMapSpec]:
        """Each parameter's matrix map as its group gives it (None: the group gives none)."""
        return _map_specs(self.param_groups, self.params)

    def maps(self) -> list[MatrixMap]:
        """Each parameter's matrix map, parsed ("flatten" where its group gives none)."""
        return [parse(spec) for spec in self.map_specs()]

    def ns_matrices(self, use_muon_default: bool = True) -> int:
        """How many matrices Newton–Schulz orthogonalises: :meth:`matrices` cut by their maps."""
        return sum(
            matrix_count(p.shape, m)
            for p, m in zip(self.params, self.maps())
            if _orthogonalised(p, self.param_groups, use_muon_default)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "source": self.source,
            "optimizer_kwargs": dict(self.optimizer_kwargs),
            "param_groups": [dict(g) for g in self.param_groups],
            "params": [{"name": p.name, "shape": list(p.shape), "group": p.group} for p in self.params],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def load_manifest(path: str | Path) -> Manifest:
    """Read and validate a manifest file; every problem names the file and the entry."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ManifestError(f"cannot read manifest {str(path)!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ManifestError(
            f"manifest {str(path)!r} is not a UTF-8 text file (byte {e.start}: {e.reason}); give a "
            "manifest .json, e.g. one written by fastmuon.bench.manifest_from_module(model).save('m.json')"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ManifestError(
            f"manifest {str(path)!r} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}"
        ) from None
    return manifest_from_dict(data, where=str(path))


def manifest_from_dict(data: Any, where: str = "<manifest>") -> Manifest:
    """Validate the JSON structure of a manifest (see the module docstring)."""
    if not isinstance(data, Mapping):
        raise ManifestError(f"{where}: a manifest must be a JSON object, got {type(data).__name__}")
    for key in ("params", "param_groups"):
        if key not in data:
            raise ManifestError(f"{where}: missing the {key!r} list")
    groups = data["param_groups"]
    if not isinstance(groups, list) or not groups or not all(isinstance(g, Mapping) for g in groups):
        raise ManifestError(f"{where}: 'param_groups' must be a non-empty list of objects")
    for i, g in enumerate(groups):
        if "use_muon" in g and not isinstance(g["use_muon"], bool):
            raise ManifestError(f"{where}: param_groups[{i}] 'use_muon' must be true or false")
    kwargs = data.get("optimizer_kwargs", {})
    if not isinstance(kwargs, Mapping):
        raise ManifestError(f"{where}: 'optimizer_kwargs' must be an object")
    if not isinstance(data["params"], list) or not data["params"]:
        raise ManifestError(f"{where}: 'params' must be a non-empty list")
    params = [_param_spec(entry, i, len(groups), where) for i, entry in enumerate(data["params"])]
    names = [p.name for p in params]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ManifestError(f"{where}: parameter name {dup!r} appears more than once")
    _check_maps(groups, params, where)
    return Manifest(
        model=str(data.get("model", Path(where).stem)),
        params=params,
        param_groups=[{k: v for k, v in g.items() if k not in _NON_HYPER_KEYS} for g in groups],
        optimizer_kwargs=dict(kwargs),
        source=str(data.get("source", "")),
    )


def _param_spec(entry: Any, i: int, num_groups: int, where: str) -> ParamSpec:
    label = f"params[{i}]"
    if not isinstance(entry, Mapping):
        raise ManifestError(f"{where}: {label} must be an object with 'name', 'shape' and 'group'")
    name = entry.get("name", label)
    label = f"{label} ({name!r})"
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        raise ManifestError(
            f"{where}: {label} has shape {shape!r}; a shape must be a list of non-negative integers"
        )
    group = entry.get("group", 0)
    if not isinstance(group, int) or isinstance(group, bool) or not 0 <= group < num_groups:
        raise ManifestError(
            f"{where}: {label} has group {group!r}; it must index param_groups (0..{num_groups - 1})"
        )
    return ParamSpec(str(name), tuple(shape), group)


def manifest_from_module(
    model: nn.Module,
    param_groups: Iterable[Mapping[str, Any]] | None = None,
    *,
    name: str | None = None,
    source: str = "",
    optimizer_kwargs: Mapping[str, Any] | None = None,
) -> Manifest:
    """Describe ``model``'s trainable parameters and groups, e.g. to benchmark your own model.

    ``param_groups`` are the groups you would give the optimizer (``params`` lists of the
    model's tensors plus hyperparameters); by default :func:`fastmuon.param_groups`. The model
    may live on the ``meta`` device, so even very large models cost no memory.
    """
    from ..groups.build import param_groups as default_groups

    groups = list(param_groups) if param_groups is not None else default_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    params: list[ParamSpec] = []
    seen: set[int] = set()
    for gi, g in enumerate(groups):
        for j, p in enumerate(g["params"]):
            if not isinstance(p, torch.Tensor):
                raise ManifestError(f"param group {gi} entry {j} is a {type(p).__name__}, not a tensor")
            if id(p) not in names:
                raise ManifestError(
                    f"param group {gi} entry {j} (shape {tuple(p.shape)}) is not a parameter of the model"
                )
            if id(p) in seen:
                raise ManifestError(f"parameter {names[id(p)]!r} appears in more than one param group")
            seen.add(id(p))
            params.append(ParamSpec(names[id(p)], tuple(p.shape), gi))
    hyper = [
        {k: _plain_maps(v) if k == "matrices" else v for k, v in g.items() if k not in _NON_HYPER_KEYS}
        for g in groups
    ]
    _check_maps(hyper, params, name or type(model).__name__)
    return Manifest(
        model=name or type(model).__name__,
        params=params,
        param_groups=[{k: v for k, v in g.items() if _json_value(v)} for g in hyper],
        optimizer_kwargs=dict(optimizer_kwargs or {}),
        source=source,
    )


def _json_value(v: Any) -> bool:
    try:
        json.dumps(v)
    except TypeError:
        return False
    return True


def _orthogonalised(p: ParamSpec, groups: Sequence[Mapping[str, Any]], use_muon_default: bool = True) -> bool:
    """Whether an optimizer orthogonalises ``p``: >=2D, in a group that does not opt out."""
    flag = groups[p.group].get("use_muon")
    return (flag if flag is not None else use_muon_default) and len(p.shape) >= 2 and p.numel > 0


def _map_specs(groups: Sequence[Mapping[str, Any]], params: list[ParamSpec]) -> list[MatrixMapSpec]:
    """Each parameter's map spec: its group's ``matrices``, or that list's entry at the
    parameter's position among its group's parameters."""
    seen = [0] * len(groups)
    specs = []
    for p in params:
        spec = groups[p.group].get("matrices")
        specs.append(spec[seen[p.group]] if isinstance(spec, list) else spec)
        seen[p.group] += 1
    return specs


def _check_maps(groups: Sequence[Mapping[str, Any]], params: list[ParamSpec], where: str) -> None:
    """Every group's ``matrices`` parses, has one map per parameter where it is a list, and
    fits the shape of each parameter it maps (one the optimizers orthogonalise)."""
    sizes = [0] * len(groups)
    for p in params:
        sizes[p.group] += 1
    for i, g in enumerate(groups):
        if "matrices" not in g:
            continue
        try:
            maps_of(g["matrices"], sizes[i])
        except ValueError as e:
            raise ManifestError(f"{where}: param_groups[{i}] 'matrices': {e}") from None
    for k, (p, spec) in enumerate(zip(params, _map_specs(groups, params))):
        if spec is None or not _orthogonalised(p, groups):
            continue
        try:
            parse(spec).check(p.shape)
        except ValueError as e:
            raise ManifestError(
                f"{where}: params[{k}] ({p.name!r}, shape {list(p.shape)}) in param_groups[{p.group}]: {e}"
            ) from None


def _plain_maps(spec: Any) -> Any:
    """A ``matrices`` entry as JSON holds it (lists for tuples, parsed maps as their specs), so
    that a manifest saved and loaded again is equal to the one saved."""
    if isinstance(spec, MatrixMap):
        return spec.plain()
    if isinstance(spec, (list, tuple)):
        return [_plain_maps(s) for s in spec]
    if isinstance(spec, Mapping):
        return {k: list(v) if isinstance(v, tuple) else v for k, v in spec.items()}
    return spec


def materialize(manifest: Manifest, device: torch.device, seed: int) -> list[nn.Parameter]:
    """Parameters with the manifest's shapes and fixed synthetic gradients (never changed after)."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for spec in manifest.params:
        p = nn.Parameter((0.02 * torch.randn(spec.shape, generator=gen)).to(device))
        p.grad = torch.randn(spec.shape, generator=gen).to(device)
        params.append(p)
    return params
