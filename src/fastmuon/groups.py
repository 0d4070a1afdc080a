"""Split a model's parameters into the Muon group and the rest.

Each trainable parameter gets a *kind* (Muon matrix, other, or no-decay) and each kind becomes
one param group. The Muon group also says how each of its tensors maps to matrices (see
:mod:`fastmuon.matrices`): detected for known layers (:mod:`fastmuon.layer_maps`), set by the caller.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from fnmatch import fnmatchcase
from typing import Any, Union

from torch import Tensor, nn

from .layer_maps import detected_maps
from .matrices import FLATTEN, MatrixMapSpec, parse

#: Attribute names of a model's output layer (Transformers' ``lm_head``, ``classifier``,
#: ``score``, ``qa_outputs``; timm's ``head``; torchvision's ``fc``, ``classifier``, ``head``).
HEAD_NAMES = frozenset(
    {"lm_head", "head", "classifier", "fc", "output", "output_layer", "score", "qa_outputs"}
)

#: What ``head=`` and ``exclude=`` accept: modules, parameters, names or glob patterns of
#: modules or parameters (``"lm_head"``, ``"blocks.*.gate"``), a predicate ``(name, param) ->
#: bool``, or a list of these.
Selector = Union[nn.Module, Tensor, str, Callable[[str, Tensor], bool], Iterable[Any], None]

# The group each kind of parameter lands in, in the order the groups are returned.
MUON = (("use_muon", True),)
OTHER = (("use_muon", False),)
NO_DECAY = (("use_muon", False), ("weight_decay", 0.0))
KINDS = (MUON, OTHER, NO_DECAY)


def param_groups(
    model: nn.Module,
    *,
    head: Selector | str = "auto",
    exclude: Selector = None,
    decay_vectors: bool = False,
    matrices: Mapping[Any, MatrixMapSpec] | None = None,
    **overrides: Any,
) -> list[dict[str, Any]]:
    """Param groups for :class:`~fastmuon.Muon` or :class:`~fastmuon.MuSGD`.

    - ``use_muon=True``: matrices (>=2D weights: linear, conv), orthogonalised;
    - ``use_muon=False``: embedding tables, the output layer ("head") and whatever ``exclude``
      names: matrices whose rows are per-token or per-class vectors, which orthogonalisation
      would mix. Muon updates them with AdamW (at its ``adamw_lr`` unless the group sets ``lr``),
      MuSGD with SGD;
    - ``use_muon=False, weight_decay=0``: norms, biases and other <2D parameters, not decayed
      (as in Ultralytics' trainer and the usual Muon/AdamW recipes); ``decay_vectors=True``
      puts them in the group above instead.

    ``head="auto"`` finds the output layer: the shallowest modules named like one
    (:data:`HEAD_NAMES`: ``lm_head``, ``head``, ``classifier``, ``fc``, ...) outside repeated
    blocks (no numeric part in their path), plus any ``nn.Linear`` outside repeated blocks
    shaped like an embedding table (an untied LM head); a head tied to an embedding shares its
    tensor and so follows it.
    If none is found and ``model`` is an ``nn.Sequential``, its last ``nn.Linear`` is the head.
    Say which it is with ``head=`` (a :data:`Selector`), or ``head=None`` for none.

    The Muon group says how each tensor maps to the matrices it orthogonalises (its
    ``"matrices"`` entry, one spec per parameter; see :mod:`fastmuon.matrices`), recognised
    for known layers (:mod:`fastmuon.layer_maps`):

    - Transformers' fused Mixture-of-Experts stacks (Mixtral, Qwen-MoE, DeepSeek, OLMoE,
      GPT-OSS, Llama-4, DBRX, ...): one matrix per expert, ``gate_up_proj``'s gate and up
      halves apart where the forward splits it in halves (not GPT-OSS, whose gate and up
      columns alternate), ``transposed`` where experts are stored (in, out); the 3-D tensors of
      other modules whose class name ends in "Experts": one matrix per leading index;
    - GPT-2's ``Conv1D`` (also OpenAI GPT, ImageGPT): ``transposed``, with attention's fused
      ``c_attn`` split into query, key and value;
    - ``nn.MultiheadAttention``'s ``in_proj_weight``: split into query, key and value.

    Everything else is "flatten"; a group of only those has no ``"matrices"`` entry.
    ``matrices=`` sets maps as a dict ``{selector: spec}``, selectors as for ``head=`` (a tuple
    of them for several). Later entries win over earlier ones and over detection, only the
    Muon group's parameters are affected, and ``"flatten"`` undoes a detection. Per-head
    orthogonalisation, for instance, is ``matrices={"*.q_proj": {"heads": 12}, "*.k_proj":
    {"heads": 4}}`` (k with the key/value head count). A selector that names none of Muon's
    parameters, or a map that does not fit its tensor, is an error naming both.

    ``overrides`` (e.g. ``ns_dtype=torch.float32``) are set on every group, except that the
    no-decay group keeps ``weight_decay=0``; hyperparameters per kind belong on the optimizer
    (e.g. ``Muon(..., adamw_lr=3e-4)``) or on the returned groups. Shared parameters appear
    once, frozen ones not at all, empty groups are left out. Each group carries torch's
    ``param_names`` (used in error messages; the optimizers accept unnamed groups next to them).
    """
    if "use_muon" in overrides:
        raise ValueError("param_groups sets use_muon itself; choose what leaves Muon with head= or exclude=")
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    heads = output_layers(model) if isinstance(head, str) and head == "auto" else head
    kept_out = embedding_weights(model) | selected(model, heads, "head") | selected(model, exclude, "exclude")
    groups: dict[tuple, dict[str, list]] = {kind: {"params": [], "param_names": []} for kind in KINDS}
    for name, p in trainable:
        kind = kind_of(p, id(p) in kept_out, decay_vectors)
        groups[kind]["params"].append(p)
        groups[kind]["param_names"].append(name)
    muon = groups[MUON]
    specs = matrix_specs(model, muon["params"], muon["param_names"], matrices)
    if specs is not None:
        muon["matrices"] = specs
    return [{**g, **overrides, **dict(kind)} for kind, g in groups.items() if g["params"]]


def matrix_specs(
    model: nn.Module, params: list[Tensor], names: list[str], matrices: Mapping[Any, MatrixMapSpec] | None
) -> list[MatrixMapSpec] | None:
    """One spec per Muon parameter (detected, then the caller's), or None if all are "flatten"."""
    detected = detected_maps(model)
    maps = {id(p): detected[id(p)] for p in params if id(p) in detected}
    set_by_caller: set[int] = set()
    if matrices is not None:
        if not isinstance(matrices, Mapping):
            raise TypeError(
                "matrices= takes a dict {selector: matrix map}, e.g. {'*.experts': 'experts'}; "
                f"got {type(matrices).__name__}"
            )
        ours = {id(p) for p in params}
        for selector, spec in matrices.items():
            hits = selected(model, selector, "matrices") & ours
            if not hits:
                raise ValueError(
                    f"matrices= selector {describe(selector)} names no parameter that Muon orthogonalises "
                    "(matrix maps apply to the >=2-D parameters left in the Muon group); select those"
                )
            try:
                m = parse(spec)
            except ValueError as e:
                raise ValueError(f"matrices= entry for {describe(selector)}: {e}") from None
            maps.update(dict.fromkeys(hits, m))
            set_by_caller |= hits
    for name, p in zip(names, params):
        m = maps.get(id(p), FLATTEN)
        try:
            m.check(p.shape)
        except ValueError as e:
            origin = "as given" if id(p) in set_by_caller else "detected from its layer"
            raise ValueError(
                f"parameter {name!r} of shape {tuple(p.shape)}, {origin}: {e}; or set its map with "
                f"param_groups(..., matrices={{{name!r}: ...}})"
            ) from None
    specs = [maps.get(id(p), FLATTEN) for p in params]
    if all(m.is_flatten for m in specs):
        return None
    return [m.plain() for m in specs]


def describe(selector: Any) -> str:
    """A short name for a selector in a message (modules and tensors print large)."""
    if isinstance(selector, nn.Module):
        return f"<{type(selector).__name__} module>"
    if isinstance(selector, Tensor):
        return f"<tensor of shape {tuple(selector.shape)}>"
    if isinstance(selector, str):
        return repr(selector)
    if callable(selector):
        return f"<predicate {getattr(selector, '__name__', type(selector).__name__)}>"
    if isinstance(selector, tuple):
        return "(" + ", ".join(describe(s) for s in selector) + ")"
    return repr(selector)


def kind_of(p: Tensor, kept_out: bool, decay_vectors: bool) -> tuple:
    if p.ndim < 2:
        return OTHER if decay_vectors else NO_DECAY
    return OTHER if kept_out else MUON


def embedding_weights(model: nn.Module) -> set[int]:
    return {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}


def output_layers(model: nn.Module) -> list[nn.Module]:
    """The modules ``param_groups(head="auto")`` treats as the output layer (see there)."""
    outside_blocks = [
        (name, m) for name, m in model.named_modules() if not any(part.isdigit() for part in name.split("."))
    ]
    named = [
        (name, m)
        for name, m in outside_blocks
        if name.rpartition(".")[2] in HEAD_NAMES and any(p.ndim >= 2 for p in m.parameters())
    ]
    depth = min((name.count(".") for name, _ in named), default=None)
    found = [m for name, m in named if name.count(".") == depth]
    tables = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Embedding)}
    found += [
        m
        for _, m in outside_blocks
        if isinstance(m, nn.Linear) and tuple(m.weight.shape) in tables and all(m is not f for f in found)
    ]
    if not found and isinstance(model, nn.Sequential):
        found = [m for m in model.modules() if isinstance(m, nn.Linear)][-1:]
    return found


def selected(model: nn.Module, selector: Selector, what: str) -> set[int]:
    """The ids of the parameters ``selector`` names; a selector that names nothing is an error."""
    if selector is None:
        return set()
    items = [selector] if isinstance(selector, (nn.Module, Tensor, str)) or callable(selector) else selector
    named_params = list(model.named_parameters(remove_duplicate=False))
    ids: set[int] = set()
    for item in items:
        found = _select_one(model, named_params, item, what)
        ids |= found
    return ids


def _select_one(model: nn.Module, named_params: list[tuple[str, Tensor]], item: Any, what: str) -> set[int]:
    if isinstance(item, nn.Module):
        if not any(m is item for m in model.modules()):
            raise ValueError(f"{what}= got a {type(item).__name__} that is not a submodule of the model")
        return {id(p) for p in item.parameters()}
    if isinstance(item, Tensor):
        if not any(p is item for _, p in named_params):
            raise ValueError(
                f"{what}= got a tensor of shape {tuple(item.shape)} that is not a parameter of the model"
            )
        return {id(item)}
    if isinstance(item, str):
        ids = {id(p) for n, p in named_params if fnmatchcase(n, item)}
        for name, m in model.named_modules():
            if name and fnmatchcase(name, item):
                ids |= {id(p) for p in m.parameters()}
        if not ids:
            examples = ", ".join(repr(n) for n, _ in named_params[:3])
            raise ValueError(
                f"{what}={item!r} matches no module or parameter name of the model (names look like "
                f"{examples}); give a module name, a parameter name or a glob pattern"
            )
        return ids
    if callable(item):
        return {id(p) for n, p in named_params if item(n, p)}
    raise TypeError(
        f"{what}= takes modules, parameters, names, predicates (name, param) -> bool or a list of "
        f"these; got {type(item).__name__}"
    )
