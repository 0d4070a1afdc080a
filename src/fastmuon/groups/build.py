"""Split a model's parameters into the Muon group and the rest: each trainable parameter gets a
*kind* (Muon matrix, other, or no-decay), each kind one param group (see :func:`param_groups`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from fnmatch import fnmatchcase
from typing import Any, Literal, Union

from torch import Tensor, nn

from ..ns.matrices import FLATTEN, MatrixMapSpec, parse
from ..optim.qk_clip import detected_parts, parse_part
from .layer_maps import detected_maps, matrix_weights, router_weights

#: Attribute names of a model's output layer (Transformers' ``lm_head``, ``classifier``,
#: ``score``, ``qa_outputs``; timm's ``head``; torchvision's ``fc``, ``classifier``, ``head``).
HEAD_NAMES = frozenset(
    {"lm_head", "head", "classifier", "fc", "output", "output_layer", "score", "qa_outputs"}
)

#: Output-layer names that count only directly on the model (inside, attention has ``out_proj``).
TOP_LEVEL_HEAD_NAMES = frozenset({"out_proj", "output_proj", "proj_out"})

#: Child names under which wrappers hold the model (``torch.compile``, FSDP1, activation
#: checkpointing; DDP, ``DataParallel`` and DeepSpeed use ``module``: see :func:`logical_names`).
WRAPPER_CHILDREN = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})

#: ``param_groups`` warns when more than this share of the body's >=2-D numel stays outside Muon.
OUTSIDE_SHARE_WARNING = 0.5

#: What ``head=`` and ``exclude=`` accept: modules, parameters, names or glob patterns of either
#: (``"lm_head"``, ``"blocks.*.gate"``), a predicate ``(name, param) -> bool``, or a list of these.
Selector = Union[nn.Module, Tensor, str, Callable[[str, Tensor], bool], Iterable[Any], None]

# The group each kind of parameter lands in, in the order the groups are returned.
MUON_KIND = (("use_muon", True),)
OTHER_KIND = (("use_muon", False),)
NO_DECAY_KIND = (("use_muon", False), ("weight_decay", 0.0))
KINDS = (MUON_KIND, OTHER_KIND, NO_DECAY_KIND)

# Why a parameter went where it went (reported by the warnings and errors below).
WHY = {
    "matrix": "a linear, conv or recognised fused/expert layer's weight",
    "include": "named by include=",
    "vector": "a norm's, a bias or another vector-shaped tensor",
    "embedding": "an embedding table",
    "head": "the output layer",
    "exclude": "named by exclude=",
    "router": "a Mixture-of-Experts router (routers='other')",
    "unrecognised": "not a recognised layer's weight (tokens, positional or bias tables, custom layers)",
}


def param_groups(
    model: nn.Module,
    *,
    head: Selector | str = "auto",
    exclude: Selector = None,
    include: Selector = None,
    routers: Literal["other", "muon"] = "other",
    decay_vectors: bool = False,
    matrices: Mapping[Any, MatrixMapSpec] | None = None,
    attention: bool | Mapping[Any, dict[str, Any] | None] = False,
    **overrides: Any,
) -> list[dict[str, Any]]:
    """Param groups for :class:`~fastmuon.Muon` or :class:`~fastmuon.MuSGD`.

    What is a matrix is decided by the module a parameter belongs to, not by its number of dims:

    - ``use_muon=True``: the weights of linear and conv layers (``nn.Linear`` and subclasses,
      ``nn.Bilinear``, ``nn.Conv*d``, ``nn.ConvTranspose*d``, Transformers' ``Conv1D``),
      ``nn.MultiheadAttention``'s input projections, recognised fused and expert layers;
    - ``use_muon=False``: embedding tables, the output layer ("head"), Mixture-of-Experts routers,
      whatever ``exclude`` names, and every other >=2-D parameter no rule recognises (a ViT's
      position embedding, relative-position bias tables, a custom layer's own tensors). Muon updates
      them with AdamW (at its ``adamw_lr`` unless the group sets ``lr``), MuSGD with SGD;
    - ``use_muon=False, weight_decay=0``: norms, biases and other vector-shaped parameters (fewer
      than 2 dims; unrecognised tensors with at most one dim above 1, or named ``bias``/``*_bias``),
      not decayed, as in the usual Muon/AdamW recipes; ``decay_vectors=True`` decays them.

    ``include`` (a :data:`Selector`) puts >=2-D parameters into Muon whatever the rules say, e.g. a
    custom layer's ``F.linear(x, self.w)`` weight (``include="*.w"``); it may not name a parameter
    that ``exclude=`` or an explicit ``head=`` also names. ``routers="other"`` (the default) keeps
    routers (the ``(experts, hidden)`` weight that scores experts per token, e.g. Mixtral's
    ``mlp.gate.weight``) out of Muon: each row scores one expert, like a classifier's rows a class,
    and orthogonalising would couple them.

    ``head="auto"`` finds the output layer: the shallowest modules named like one
    (:data:`HEAD_NAMES`) outside repeated blocks (no numeric part in their path), ``out_proj`` and
    the like (:data:`TOP_LEVEL_HEAD_NAMES`) directly on the model, and any ``nn.Linear`` outside
    repeated blocks shaped like an embedding table (an untied LM head; a tied one is the embedding);
    failing that, an ``nn.Sequential``'s last ``nn.Linear``. Wrappers (``torch.compile``, DDP,
    FSDP1, a LightningModule's ``self.net``) are seen through. If none is found it warns; say
    ``head=None`` for a model without one.

    No silent fall-back: when nothing would go to Muon it raises, saying where every parameter went
    and why; when more than :data:`OUTSIDE_SHARE_WARNING` of the body's >=2-D parameters by numel
    (all but embeddings and the output layer) stays out for a reason other than ``exclude=``, it
    warns, naming them (``include=`` puts them in, ``exclude=`` keeps them out silently).

    The Muon group's ``"matrices"`` entry (one spec per parameter; :mod:`fastmuon.ns.matrices`) is
    detected for known layers (:mod:`fastmuon.groups.layer_maps`): Transformers' fused MoE stacks
    (Mixtral, Qwen-MoE, DeepSeek, OLMoE, GPT-OSS, Llama-4, DBRX, ...) one matrix per expert with
    ``gate_up_proj``'s gate and up apart, other ``*Experts`` modules' 3-D tensors one per leading
    index, GPT-2's ``Conv1D`` transposed, and fused q/k/v projections (``c_attn``,
    ``in_proj_weight``) split in three; the rest is "flatten" (no entry if all are). ``matrices=``
    sets maps as ``{selector: spec}`` (a tuple of selectors for several); later entries win over
    earlier ones and over detection, and ``"flatten"`` undoes one. Per-head NS, for instance:
    ``matrices={"*.q_proj": {"heads": 12}, "*.k_proj": {"heads": 4}}`` (k with the key/value head
    count). A selector naming none of Muon's parameters, or a map that does not fit, is an error.

    ``attention=True`` marks attention queries and keys for QK-clip (``Muon(..., qk_clip_tau=...)``):
    each group holding some gets an ``"attention"`` entry, one part per parameter (None for others;
    :mod:`fastmuon.optim.qk_clip`), detected for Llama-family and DeepSeek-V3 attention. A dict
    ``{selector: part}`` adds parts (or, with ``None``, removes them), e.g. ``{"blocks.*.attn.wq":
    {"part": "query", "heads": 8}}``; a part without ``"layer"`` belongs to the module two levels up.

    Name selectors match with or without the wrappers' prefixes. ``overrides`` (``ns_dtype=...``)
    are set on every group, but the no-decay group keeps ``weight_decay=0``; per-kind settings
    belong on the optimizer (``Muon(..., adamw_lr=3e-4)``) or the returned groups. Shared parameters
    appear once, frozen ones and empty groups not at all; each group carries torch's ``param_names``.
    """
    if "use_muon" in overrides:
        raise ValueError(
            "param_groups sets use_muon itself; choose what leaves Muon with head= or exclude=, "
            "what joins it with include="
        )
    if routers not in ("other", "muon"):
        raise ValueError(f"routers= is 'other' (the non-Muon part, the default) or 'muon'; got {routers!r}")
    trainable: list[tuple[str, Tensor]] = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    auto_head = isinstance(head, str) and head == "auto"
    heads = output_layers(model) if auto_head else head
    reasons: dict[int, str] = {}  # id -> why it is kept out of Muon, first reason wins
    for why, ids in (
        ("exclude", selected(model, exclude, "exclude")),
        ("head", selected(model, heads, "head")),
        ("embedding", embedding_weights(model)),
        ("router", router_weights(model) if routers == "other" else set()),
    ):
        for i in ids:
            reasons.setdefault(i, why)
    included = selected(model, include, "include")
    check_include(trainable, included, reasons, explicit_head=not auto_head and head is not None)
    matrix_ids = matrix_weights(model) | (router_weights(model) if routers == "muon" else set())
    groups: dict[tuple, dict[str, list]] = {kind: {"params": [], "param_names": []} for kind in KINDS}
    why_of: dict[int, str] = {}
    for name, p in trainable:
        kind, why = kind_of(name, p, included, reasons, matrix_ids, decay_vectors)
        groups[kind]["params"].append(p)
        groups[kind]["param_names"].append(name)
        why_of[id(p)] = why
    check_split(trainable, why_of, warn_no_head=auto_head and not heads)
    muon = groups[MUON_KIND]
    specs = muon_matrix_maps(model, muon["params"], muon["param_names"], matrices)
    if specs is not None:
        muon["matrices"] = specs
    if attention is not False:
        attention_entries(model, trainable, list(groups.values()), attention)
    return [{**g, **overrides, **dict(kind)} for kind, g in groups.items() if g["params"]]


def kind_of(
    name: str,
    p: Tensor,
    included: set[int],
    reasons: Mapping[int, str],
    matrix_ids: set[int],
    decay_vectors: bool,
) -> tuple[tuple, str]:
    """The group a parameter goes to, and why (a key of :data:`WHY`)."""
    vector = OTHER_KIND if decay_vectors else NO_DECAY_KIND
    if p.ndim < 2:
        return vector, "vector"
    if id(p) in included:
        return MUON_KIND, "include"
    if id(p) in reasons:
        return OTHER_KIND, reasons[id(p)]
    if id(p) in matrix_ids:
        return MUON_KIND, "matrix"
    last = name.rpartition(".")[2]
    if sum(s > 1 for s in p.shape) <= 1 or last == "bias" or last.endswith("_bias"):
        return vector, "vector"
    return OTHER_KIND, "unrecognised"


def check_include(
    trainable: list[tuple[str, Tensor]], included: set[int], reasons: Mapping[int, str], explicit_head: bool
) -> None:
    """``include=`` may name only >=2-D parameters the caller did not also keep out."""
    for name, p in trainable:
        if id(p) not in included:
            continue
        if p.ndim < 2:
            raise ValueError(
                f"include= names {name!r} of shape {tuple(p.shape)}: Muon orthogonalises matrices, "
                "not vectors; select only parameters of 2 or more dims"
            )
        why = reasons.get(id(p))
        if why == "exclude" or (why == "head" and explicit_head):
            raise ValueError(f"{name!r} is named by both include= and {why}=; name it in only one of them")


def check_split(trainable: list[tuple[str, Tensor]], why_of: Mapping[int, str], warn_no_head: bool) -> None:
    """Refuse a split with nothing for Muon; warn where a large share of the body stays out."""
    by_why: dict[str, list[tuple[str, Tensor]]] = {}
    for name, p in trainable:
        by_why.setdefault(why_of[id(p)], []).append((name, p))
    in_muon = by_why.get("matrix", []) + by_why.get("include", [])
    if not in_muon:
        where = "; ".join(f"{WHY[w]}: {tally(by_why[w])}" for w in WHY if w in by_why) or "none is trainable"
        raise ValueError(
            f"param_groups put no parameter into Muon, so Muon would orthogonalise nothing. Of the "
            f"model's {len(trainable)} trainable tensors: {where}. Name the matrices to orthogonalise "
            "with include= (names, globs, modules or parameters, e.g. include='blocks.*.w'), or use "
            "a plain optimizer (torch.optim.AdamW, SGD) for this model"
        )
    if warn_no_head:
        warnings.warn(
            "param_groups found no output layer (no module named lm_head, head, classifier, fc, "
            "output, ... outside repeated blocks), so every linear layer, the last one included, "
            "goes to Muon; name the output layer with head='<module name>' to keep it out, or pass "
            "head=None if the model has none",
            UserWarning,
            stacklevel=3,
        )
    body = [(n, p) for n, p in trainable if p.ndim >= 2 and why_of[id(p)] not in ("embedding", "head")]
    out_whys = ("router", "unrecognised")
    outside = [(n, p) for n, p in body if why_of[id(p)] in out_whys]
    body_numel = sum(p.numel() for _, p in body if why_of[id(p)] != "exclude")
    outside_numel = sum(p.numel() for _, p in outside)
    if body_numel and outside_numel > OUTSIDE_SHARE_WARNING * body_numel:
        parts = "; ".join(f"{WHY[w]}: {tally(by_why[w])}" for w in out_whys if w in by_why)
        warnings.warn(
            f"param_groups leaves {outside_numel:,} of the {body_numel:,} parameters of the model's "
            f"body ({outside_numel / body_numel:.0%}; all >=2-D tensors but embeddings and the output "
            f"layer) outside Muon, and Muon orthogonalises only {tally(in_muon)}. Outside: {parts}. "
            "If these are matrices, name them with include= (e.g. include='*.w'); if they are meant "
            "to stay with the other optimizer, say so with exclude= (or routers='muon' for routers)",
            UserWarning,
            stacklevel=3,
        )


def tally(named: list[tuple[str, Tensor]], shown: int = 3) -> str:
    """``"2 tensors (1,234 parameters), e.g. 'a' (3, 4), 'b' (5, 6)"``."""
    numel = sum(p.numel() for _, p in named)
    examples = ", ".join(f"{n!r} {tuple(p.shape)}" for n, p in named[:shown])
    more = ", ..." if len(named) > shown else ""
    noun = "tensor" if len(named) == 1 else "tensors"
    return f"{len(named)} {noun} ({numel:,} parameters), e.g. {examples}{more}"


def muon_matrix_maps(
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


def attention_entries(
    model: nn.Module,
    trainable: list[tuple[str, Tensor]],
    groups: list[dict[str, Any]],
    attention: bool | Mapping[Any, dict[str, Any] | None],
) -> None:
    """Set each group's ``"attention"`` parts (detected, then the caller's) where it holds any."""
    if not (attention is True or isinstance(attention, Mapping)):
        raise TypeError(
            "attention= is True (the recognised attention layers' queries and keys) or a dict "
            f"{{selector: part}}; got {attention!r}"
        )
    parts: dict[int, dict[str, Any] | None] = dict(detected_parts(model))
    names = {id(p): n for n, p in trainable}
    for selector, spec in attention.items() if isinstance(attention, Mapping) else ():
        hits = selected(model, selector, "attention") & names.keys()
        if not hits:
            raise ValueError(f"attention= selector {describe(selector)} names no trainable parameter")
        for i in hits:
            part = None if spec is None else {"layer": names[i].rsplit(".", 2)[0], **spec}
            try:
                parse_part(part)
            except ValueError as e:
                raise ValueError(f"attention= entry for {describe(selector)}: {e}") from None
            parts[i] = part
    if not any(parts.get(i) for i in names):
        raise ValueError(
            "param_groups(attention=...) found no attention query or key parameter: no Llama-family "
            "(q_proj/k_proj) or DeepSeek-V3 (q_b_proj/kv_b_proj) attention layer is recognised in the "
            "model; name them with attention={'<q name or glob>': {'part': 'query', 'heads': H}, ...}"
        )
    for group in groups:
        entries = [parts.get(id(p)) for p in group["params"]]
        for name, p, entry in zip(group["param_names"], group["params"], entries):
            if entry is not None:
                try:
                    parse_part(entry).check(tuple(p.shape))  # type: ignore[union-attr]
                except ValueError as e:
                    raise ValueError(
                        f"attention part of {name!r} {tuple(p.shape)}: {e}; give its part with "
                        f"param_groups(..., attention={{{name!r}: ...}})"
                    ) from None
        if any(e is not None for e in entries):
            group["attention"] = entries


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


def embedding_weights(model: nn.Module) -> set[int]:
    return {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}


def output_layers(model: nn.Module) -> list[nn.Module]:
    """The modules ``param_groups(head="auto")`` treats as the output layer (see there)."""
    root, tree = search_root(model)
    outside_blocks = [(name, m) for name, m in tree if not any(part.isdigit() for part in name.split("."))]
    named = [
        (name, m)
        for name, m in outside_blocks
        if (
            name.rpartition(".")[2] in HEAD_NAMES
            or ("." not in name and name in TOP_LEVEL_HEAD_NAMES and isinstance(m, nn.Linear))
        )
        and any(p.ndim >= 2 for p in m.parameters())
    ]
    depth = min((name.count(".") for name, _ in named), default=None)
    found = [m for name, m in named if name.count(".") == depth]
    tables = {tuple(m.weight.shape) for m in root.modules() if isinstance(m, nn.Embedding)}
    found += [
        m
        for _, m in outside_blocks
        if isinstance(m, nn.Linear) and tuple(m.weight.shape) in tables and all(m is not f for f in found)
    ]
    if not found and isinstance(root, nn.Sequential):
        linears: list[nn.Module] = [m for m in root.modules() if isinstance(m, nn.Linear)]
        found = linears[-1:]
    return found


def search_root(model: nn.Module) -> tuple[nn.Module, list[tuple[str, nn.Module]]]:
    """The module the head search looks in and its submodules by name: a module with no parameter
    of its own and one child with parameters and submodules (a wrapper) is searched as that child."""
    root = model
    while not any(True for _ in root.parameters(recurse=False)):
        with_params = [c for c in root.children() if any(True for _ in c.parameters())]
        if len(with_params) != 1 or not any(True for _ in with_params[0].children()):
            break  # several children, or one leaf layer (the head of a one-layer Sequential)
        root = with_params[0]
    return root, [(name, m) for name, m in logical_names(root) if name]


def logical_names(model: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``named_modules`` without the path parts that wrappers add (:data:`WRAPPER_CHILDREN`, and
    ``module`` where it is its parent's only child with parameters); each module once."""
    seen: set[int] = set()

    def walk(module: nn.Module, name: str) -> Iterator[tuple[str, nn.Module]]:
        if id(module) in seen:
            return
        seen.add(id(module))
        yield name, module
        children = list(module.named_children())
        for child_name, child in children:
            yield from walk(
                child, name if is_wrapper_edge(module, child_name, children) else join(name, child_name)
            )

    yield from walk(model, prefix)


def is_wrapper_edge(parent: nn.Module, child_name: str, children: list[tuple[str, nn.Module]]) -> bool:
    if child_name in WRAPPER_CHILDREN:
        return True
    if child_name != "module" or any(True for _ in parent.parameters(recurse=False)):
        return False
    return sum(any(True for _ in c.parameters()) for _, c in children) == 1


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def logical_param_names(model: nn.Module) -> list[tuple[str, Tensor]]:
    """``(name, param)`` for every parameter under its name without wrappers' path parts."""
    out: list[tuple[str, Tensor]] = []
    for name, module in logical_names(model):
        out += [(join(name, n), p) for n, p in module.named_parameters(recurse=False)]
    return out


def selected(model: nn.Module, selector: Selector, what: str) -> set[int]:
    """The ids of the parameters ``selector`` names; a selector that names nothing is an error."""
    if selector is None:
        return set()
    items = [selector] if isinstance(selector, (nn.Module, Tensor, str)) or callable(selector) else selector
    named_params: list[tuple[str, Tensor]] = list(model.named_parameters(remove_duplicate=False))
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
        ids |= {id(p) for n, p in logical_param_names(model) if fnmatchcase(n, item)}
        for name, m in [*model.named_modules(), *logical_names(model)]:
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
