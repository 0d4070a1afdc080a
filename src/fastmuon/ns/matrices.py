"""How a parameter tensor maps to the matrices Newton–Schulz orthogonalises.

A conv kernel ``(out, in, kh, kw)`` is one matrix ``(out, in·kh·kw)`` ("flatten", the default); an
MoE stack ``(E, out, in)`` is E matrices, a fused projection (GPT-2's ``c_attn``, a gate/up pair)
several, per-head NS one per head. A *matrix map* (``matrices``, per group or parameter) says which:

- ``"flatten"``: the whole tensor as ``(shape[0], everything else)``;
- ``{"batch_dims": b}`` (``"experts"``: b = 1): the first ``b`` dims index separate matrices;
- ``{"split": [s1, s2, ...], "dim": d}``: each matrix is cut along its output (``d=0``, the
  default) or input (``d=1``) dim into parts of these sizes, each orthogonalised alone;
- ``{"heads": n, "dim": d}``: the same cut into ``n`` equal parts;
- ``"interleaved": True`` beside ``split`` or ``heads``: the parts alternate along that dim, part
  ``k`` taking rows ``k, k+n, k+2n, ...`` as a strided view (GPT-OSS's ``gate_up_proj``:
  ``{"batch_dims": 1, "split": [I, I], "interleaved": True, "transposed": True}``);
- ``{"transposed": True}``: stored ``(in, out)`` (GPT-2's ``Conv1D``), so ``d`` and the
  learning-rate factor refer to its transpose; as ``NS(Xᵀ) = NS(X)ᵀ`` it is orthogonalised as stored.

The keys combine (batch, then split); a list gives one map per parameter of its group. Maps are
plain strings and dicts, so they travel in ``state_dict()`` and load with ``weights_only``.
Per-expert batching follows the proposals for torch.optim.Muon and Primus; splitting fused
projections and per-head NS follow Dion's ``split_sizes``/``num_heads`` options.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import Tensor

#: What a group's ``matrices`` entry holds: a map (string or dict), or a list of maps, one per parameter.
MatrixMapSpec = Union[str, dict[str, Any], None]

KEYS = ("batch_dims", "split", "heads", "dim", "interleaved", "transposed")
SHORTHANDS: dict[str, dict[str, Any]] = {
    "flatten": {},
    "experts": {"batch_dims": 1},
    "transposed": {"transposed": True},
}

#: A piece of a tensor: an index into it (ints for batch dims, a slice, strided if interleaved).
Box = tuple[Union[int, slice], ...]


@dataclass(frozen=True)
class MatrixMap:
    """A parsed matrix map (see the module docstring); ``parse`` builds one from a spec."""

    batch_dims: int = 0
    split: tuple[int, ...] | None = None
    heads: int | None = None
    dim: int = 0
    transposed: bool = False
    interleaved: bool = False

    @property
    def is_flatten(self) -> bool:
        return self == FLATTEN

    def stored_dim(self) -> int:
        """The tensor dim a split cuts: the output or input dim of each (transposed?) matrix."""
        return self.batch_dims + (1 - self.dim if self.transposed else self.dim)

    def check(self, shape: Sequence[int]) -> None:
        """Raise ``ValueError`` (what is wrong, and the fix) unless this map fits ``shape``."""
        shape = tuple(shape)
        b = self.batch_dims
        if len(shape) < b + 2:
            raise ValueError(
                f"its matrix map {self.plain()!r} needs at least {b + 2} dims ({b} batch dim(s) and a "
                f"matrix), the tensor has {len(shape)}; use 'flatten' or fewer batch_dims"
            )
        if self.transposed and len(shape) != b + 2:
            raise ValueError(
                f"its matrix map {self.plain()!r} says each matrix is stored transposed (in, out), but "
                f"a matrix of shape {shape[b:]} is not 2-D; drop 'transposed' for conv-like tensors"
            )
        cut = self.part_sizes(shape)
        if cut is not None:
            size = shape[self.stored_dim()]
            if self.interleaved:
                self._check_interleaved(size, len(cut))
            if self.heads is not None and size % self.heads:
                raise ValueError(
                    f"its matrix map {self.plain()!r} cuts dim {self.stored_dim()} (size {size}) into "
                    f"{self.heads} heads, which does not divide it; give a head count that divides {size}"
                )
            if sum(cut) != size:
                raise ValueError(
                    f"its matrix map {self.plain()!r} cuts dim {self.stored_dim()} (size {size}) into "
                    f"sizes {list(cut)}, which add up to {sum(cut)}; give sizes that sum to {size}"
                )

    def _check_interleaved(self, size: int, n: int) -> None:
        """Interleaved parts take every ``n``-th entry: ``n`` divides the dim, a split gives equal shares."""
        where = (
            f"its matrix map {self.plain()!r} interleaves {n} parts along dim {self.stored_dim()} "
            f"(size {size}; part k takes entries k, k+{n}, k+{2 * n}, ...)"
        )
        if size % n:
            raise ValueError(
                f"{where}, and {n} does not divide {size}; give a part count that divides {size}"
            )
        if self.split is not None and sum(self.split) != size:
            raise ValueError(
                f"{where}, {size // n} entries each, but split is {list(self.split)}; "
                f"give split {[size // n] * n}"
            )

    def part_sizes(self, shape: Sequence[int]) -> tuple[int, ...] | None:
        """The sizes the split dim is cut into, or None when nothing is cut."""
        if self.split is not None:
            return self.split
        if self.heads is not None:  # equal parts (check() refuses a count that does not divide)
            return (shape[self.stored_dim()] // self.heads,) * self.heads
        return None

    def boxes(self, shape: Sequence[int]) -> list[Box]:
        """Each matrix as an index into the tensor, batch index first, then split part."""
        shape = tuple(shape)
        batch = [()] if self.batch_dims == 0 else _indices(shape[: self.batch_dims])
        cut = self.part_sizes(shape)
        if cut is None:
            return [tuple(index) for index in batch]
        rel = self.stored_dim() - self.batch_dims  # the split dim within each matrix
        fill = (slice(None),) * rel
        if self.interleaved:  # part k: rows k, k + n, k + 2n, ... of the split dim
            n, size = len(cut), shape[self.stored_dim()]
            return [(*index, *fill, slice(k, size, n)) for index in batch for k in range(n)]
        starts = [sum(cut[:k]) for k in range(len(cut))]
        return [(*index, *fill, slice(a, a + s)) for index in batch for a, s in zip(starts, cut)]

    def shapes(self, shape: Sequence[int]) -> list[tuple[int, ...]]:
        """Each matrix's shape as the learning-rate factor reads it, ``(out, in, ...)``: for
        "flatten" the tensor's own (factors reading the raw shape still do), transposed reversed."""
        shape = tuple(shape)
        if self.is_flatten:
            return [shape]
        out = []
        for box in self.boxes(shape):
            piece = box_shape(shape, box)
            out.append(piece[::-1] if self.transposed else piece)
        return out

    def views(self, t: Tensor) -> list[Tensor]:
        """Each matrix as a view of ``t`` (as stored), in :meth:`boxes` order, made with a few view
        ops (one ``split``, one ``unbind`` per part), not an index op per matrix: runs every step."""
        if self.is_flatten:
            return [t]
        b = self.batch_dims
        batched = t if b == 1 else t.unsqueeze(0) if b == 0 else t.flatten(0, b - 1)
        cut = self.part_sizes(t.shape)
        if cut is None:
            return list(batched.unbind(0))
        d = self.stored_dim() - b + 1  # the split dim of ``batched``
        if self.interleaved:  # (…, rows, …) as (…, rows / n, n, …): part k is index k of the new dim
            n = len(cut)
            rows = batched.unflatten(d, (batched.shape[d] // n, n))
            split = [rows.select(d + 1, k) for k in range(n)]
        else:
            split = list(batched.split(cut, dim=d))
        # parts[k][e]: part k of matrix e; boxes run batch-major (matrix e's parts together)
        parts = [part.unbind(0) for part in split]
        return [part[e] for e in range(batched.shape[0]) for part in parts]

    def assemble(
        self, shape: Sequence[int], results: Sequence[Tensor], dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        """One tensor of ``shape`` from its matrices' results (in :meth:`boxes` order)."""
        out = torch.empty(tuple(shape), dtype=dtype, device=device)
        for box, result in zip(self.boxes(shape), results):
            out[box] = result
        return out

    def plain(self) -> str | dict[str, Any]:
        """This map as a spec (a string where a shorthand says it), for state dicts and messages."""
        spec: dict[str, Any] = {}
        if self.batch_dims:
            spec["batch_dims"] = self.batch_dims
        if self.split is not None:
            spec["split"] = list(self.split)
        if self.heads is not None:
            spec["heads"] = self.heads
        if self.dim:
            spec["dim"] = self.dim
        if self.interleaved:
            spec["interleaved"] = True
        if self.transposed:
            spec["transposed"] = True
        for name, short in SHORTHANDS.items():
            if spec == short:
                return name
        return spec


FLATTEN = MatrixMap()


def parse(spec: MatrixMapSpec) -> MatrixMap:
    """A spec (``None``/"flatten", "experts", "transposed", a dict of :data:`KEYS`, or a
    :class:`MatrixMap`) as a :class:`MatrixMap`; ``ValueError`` saying what is accepted otherwise."""
    if isinstance(spec, MatrixMap):
        return spec
    if spec is None:
        return FLATTEN
    if isinstance(spec, str):
        if spec not in SHORTHAND_MAPS:
            raise ValueError(
                f"unknown matrix map {spec!r}; choose one of {sorted(SHORTHANDS)} or a dict with keys {KEYS}"
            )
        return SHORTHAND_MAPS[spec]
    if isinstance(spec, dict):
        unknown = sorted(set(spec) - set(KEYS), key=str)
        if unknown:
            raise ValueError(f"matrix map {spec!r} has unknown key(s) {unknown}; the keys are {KEYS}")
        items = tuple((k, tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in sorted(spec.items()))
        try:
            return _parse_items(_typed(items), items)
        except TypeError:  # an unhashable value (a tensor, a dict): report it as a bad value
            return _parse_items_uncached(items)
    raise ValueError(
        f"a matrix map is a string ({sorted(SHORTHANDS)}) or a dict with keys {KEYS}, "
        f"got {type(spec).__name__}"
    )


@functools.lru_cache(maxsize=256)
def _parse_items(_key: Any, items: tuple[tuple[str, Any], ...]) -> MatrixMap:
    return _parse_items_uncached(items)


def _typed(value: Any) -> Any:
    """``value`` with the type of every part beside it: values that compare equal (2 and 2.0,
    True and 1) are not the same spec, and one must not be taken from the cache for the other."""
    if isinstance(value, tuple):
        return tuple(map(_typed, value))
    return (type(value), value)


def _parse_items_uncached(items: tuple[tuple[str, Any], ...]) -> MatrixMap:
    spec = dict(items)
    batch_dims = spec.get("batch_dims", 0)
    if not _is_int(batch_dims) or batch_dims < 0:
        raise ValueError(f"batch_dims of a matrix map must be an int >= 0, got {batch_dims!r}")
    split, heads = spec.get("split"), spec.get("heads")
    if split is not None and heads is not None:
        raise ValueError("a matrix map takes 'split' (sizes) or 'heads' (a count), not both")
    if split is not None:
        if not isinstance(split, tuple) or not split or not all(_is_int(s) and s > 0 for s in split):
            raise ValueError(f"split of a matrix map must be a list of positive ints, got {split!r}")
        split = tuple(int(s) for s in split)
    if heads is not None and (not _is_int(heads) or heads < 1):
        raise ValueError(f"heads of a matrix map must be an int >= 1, got {heads!r}")
    dim = spec.get("dim", 0)
    if not _is_int(dim) or dim not in (0, 1):
        raise ValueError(f"dim of a matrix map must be 0 (output dim) or 1 (input dim), got {dim!r}")
    if "dim" in spec and split is None and heads is None:
        raise ValueError("'dim' of a matrix map says which dim 'split' or 'heads' cuts; give one of them")
    transposed = spec.get("transposed", False)
    if not isinstance(transposed, bool):
        raise ValueError(f"transposed of a matrix map must be True or False, got {transposed!r}")
    interleaved = spec.get("interleaved", False)
    if not isinstance(interleaved, bool):
        raise ValueError(f"interleaved of a matrix map must be True or False, got {interleaved!r}")
    if interleaved and split is None and heads is None:
        raise ValueError(
            "'interleaved' of a matrix map says the parts of 'split' or 'heads' alternate; give one "
            "of them (e.g. {'split': [I, I], 'interleaved': True} for alternating gate and up rows)"
        )
    if interleaved and split is not None and len(set(split)) > 1:
        raise ValueError(
            f"interleaved parts of a matrix map take every n-th row, so they are equal, but split is "
            f"{list(split)}; give equal sizes, or drop 'interleaved' for parts that lie side by side"
        )
    heads = None if heads is None else int(heads)
    return MatrixMap(int(batch_dims), split, heads, dim, transposed, interleaved)


def maps_of(spec: MatrixMapSpec | list[MatrixMapSpec], count: int) -> list[MatrixMap]:
    """A group's ``matrices`` entry as one map per parameter (a list must have one per parameter)."""
    if isinstance(spec, (list, tuple)):
        if len(spec) != count:
            raise ValueError(
                f"matrices holds {len(spec)} maps but the group has {count} parameters; give one map "
                "(for all of them) or a list with one per parameter"
            )
        return [parse(s) for s in spec]
    one = parse(spec)
    return [one] * count


def maps_key(spec: Any) -> Any:
    """A hashable stand-in for a group's ``matrices`` entry (read every step; a string is its own)."""
    if isinstance(spec, (str, type(None), MatrixMap)):
        return spec
    if isinstance(spec, dict):
        return tuple(sorted((k, maps_key(v)) for k, v in spec.items()))
    if isinstance(spec, (list, tuple)):
        return tuple(maps_key(v) for v in spec)
    return spec


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _indices(shape: Sequence[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for size in shape:
        out = [(*index, k) for index in out for k in range(size)]
    return out


def box_shape(shape: tuple[int, ...], box: Box) -> tuple[int, ...]:
    """The shape of ``t[box]`` for a tensor of ``shape``."""
    dims: list[int] = []
    for d, size in enumerate(shape):
        index = box[d] if d < len(box) else slice(None)
        if isinstance(index, slice):
            dims.append(len(range(*index.indices(size))))
    return tuple(dims)


def count(shape: Sequence[int], m: MatrixMap) -> int:
    """How many matrices ``m`` makes of a tensor of ``shape``."""
    batch = math.prod(shape[: m.batch_dims])
    cut = m.part_sizes(shape)
    return batch * (1 if cut is None else len(cut))


#: The shorthands parsed once (a string spec, the usual case, costs a dict lookup).
SHORTHAND_MAPS = {name: _parse_items_uncached(tuple(spec.items())) for name, spec in SHORTHANDS.items()}
