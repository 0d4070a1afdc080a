"""Interleaved parts: a tensor whose gate and up rows (or heads) alternate, as GPT-OSS stores its
experts' ``gate_up_proj``, is orthogonalised part by part, each part a strided view.

The reference de-interleaves every tensor (each part's rows together, ``reference_impl.py``),
steps it with the per-matrix fp32 references on contiguous pieces written out by hand, and
interleaves the result back: momentum and weight decay are elementwise, so only the NS of each
de-interleaved part decides the update.
"""

from __future__ import annotations

import functools
import io
import itertools
import math

import pytest
import torch
from conftest import rel_err
from helpers import clone_params, make_grads, make_params, run_checking_grads_untouched
from hypothesis import given, settings
from hypothesis import strategies as st
from integration_support import import_offline
from reference_impl import (
    deinterleaved,
    interleaved,
    muon_reference_pieces,
    musgd_reference_pieces,
    ns_reference,
    variant_reference_step,
)
from torch import nn

import fastmuon
from fastmuon import Muon, MuSGD, newton_schulz, orthogonalize, param_groups
from fastmuon.bench import resolve_workload
from fastmuon.bench.contenders import (
    Unavailable,
    Workbench,
    fastmuon_contender,
    reference_contender,
    torch_muon_fp32_contender,
    ultralytics_fp32_contender,
)
from fastmuon.bench.lineup import CLASSES
from fastmuon.bench.manifest import materialize
from fastmuon.bench.mapped import gpt_oss_like_decoder, gpt_oss_like_groups
from fastmuon.bench.workloads import Generated, manifest_of
from fastmuon.distributed.parts import Parts, whole_region
from fastmuon.distributed.sharded import held_pieces
from fastmuon.ns.matrices import count, parse
from fastmuon.scale import parse_layout, rank_regions
from fastmuon.scale.figures import matrices as scale_matrices
from fastmuon.scale.models import COLWISE, ROWWISE, Workload
from fastmuon.scale.models import Tensor as ScaleTensor

ALL = slice(None)
F32 = torch.float32

# name: (shape, spec, the interleaved dim of the tensor, its part count, the matrices of the
# de-interleaved tensor by hand: (index, stored (in, out)?))
LAYOUTS = {
    "gpt_oss": (  # (E, H, 2I) stored (in, out), gate = columns 0::2, up = 1::2
        (3, 8, 12),
        {"batch_dims": 1, "split": [6, 6], "interleaved": True, "transposed": True},
        2,
        2,
        [((e, ALL, slice(a, a + 6)), True) for e in range(3) for a in (0, 6)],
    ),
    "experts_rows": (  # (E, 2I, H): gate and up rows alternate
        (2, 8, 6),
        {"batch_dims": 1, "split": [4, 4], "interleaved": True},
        1,
        2,
        [((e, slice(a, a + 4)), False) for e in range(2) for a in (0, 4)],
    ),
    "rows": (
        (12, 5),
        {"split": [6, 6], "interleaved": True},
        0,
        2,
        [((slice(a, a + 6),), False) for a in (0, 6)],
    ),
    "three_heads": (
        (9, 4),
        {"heads": 3, "interleaved": True},
        0,
        3,
        [((slice(a, a + 3),), False) for a in (0, 3, 6)],
    ),
    "columns": (
        (5, 8),
        {"heads": 2, "dim": 1, "interleaved": True},
        1,
        2,
        [((ALL, slice(a, a + 4)), False) for a in (0, 4)],
    ),
    "conv1d_qkv": (  # (in, 3·out) stored transposed, q, k and v outputs alternating
        (4, 12),
        {"split": [4, 4, 4], "interleaved": True, "transposed": True},
        1,
        3,
        [((ALL, slice(a, a + 4)), True) for a in (0, 4, 8)],
    ),
    "conv": (
        (8, 3, 3, 3),
        {"heads": 2, "interleaved": True},
        0,
        2,
        [((slice(a, a + 4),), False) for a in (0, 4)],
    ),
}

MUON_HP = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
MUSGD_HP = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2, muon=0.3, sgd=0.7)


def layout_params(names=LAYOUTS):
    names = list(names)
    params = make_params([LAYOUTS[n][0] for n in names])
    return names, params, [LAYOUTS[n][1] for n in names]


def deinterleaved_reference(step, names, params, grads, **hyper):
    """``step`` (a ``*_reference_pieces`` function) on every tensor de-interleaved, each with
    the contiguous pieces of its layout; the results interleaved back."""
    layouts = [LAYOUTS[n] for n in names]
    ref = [deinterleaved(p.detach(), dim, n) for p, (_, _, dim, n, _) in zip(params, layouts)]
    states = [{} for _ in ref]
    for step_grads in grads:
        for q, g, state, (_, _, dim, n, pieces) in zip(ref, step_grads, states, layouts):
            step(q, deinterleaved(g, dim, n), state, pieces, **hyper)
    return [interleaved(q, dim, n) for q, (_, _, dim, n, _) in zip(ref, layouts)]


# ----- the maps' geometry ---------------------------------------------------------------------
@st.composite
def interleaved_maps(draw):
    batch_dims = draw(st.integers(0, 2))
    batch = draw(st.lists(st.integers(1, 3), min_size=batch_dims, max_size=batch_dims))
    transposed = draw(st.booleans())
    matrix = draw(st.lists(st.integers(1, 4), min_size=2, max_size=2 if transposed else 3))
    dim = draw(st.integers(0, 1))
    stored = batch_dims + (1 - dim if transposed else dim)
    parts = draw(st.integers(1, 4))
    matrix[stored - batch_dims] *= parts
    shape = (*batch, *matrix)
    spec: dict = {"batch_dims": batch_dims, "transposed": transposed, "dim": dim, "interleaved": True}
    if draw(st.booleans()):
        spec["heads"] = parts
    else:
        spec["split"] = [shape[stored] // parts] * parts
    return shape, spec, stored, parts


@settings(max_examples=150, deadline=None)
@given(interleaved_maps())
def test_interleaved_views_are_strided_views_of_every_nth_row(case):
    shape, spec, stored, parts = case
    m = parse(spec)
    m.check(shape)
    t = torch.arange(torch.Size(shape).numel(), dtype=F32).view(shape)
    views, boxes, shapes = m.views(t), m.boxes(shape), m.shapes(shape)
    assert len(views) == len(boxes) == len(shapes) == count(shape, m)
    covered = torch.zeros(shape, dtype=torch.int64)
    rows = shape[stored]
    for j, (v, box, s) in enumerate(zip(views, boxes, shapes)):
        k = j % parts  # boxes run batch-major: a matrix's parts together
        assert box[stored] == slice(k, rows, parts)
        by_hand = t.index_select(stored, torch.arange(k, rows, parts))[box[: m.batch_dims]]
        assert torch.equal(v, by_hand) and torch.equal(v, t[box])
        # a view of t, not a copy: it starts at row k and steps ``parts`` rows at a time
        assert v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        assert v.stride(stored - m.batch_dims) == parts * t.stride(stored)
        assert v.storage_offset() == t[box].storage_offset()
        covered[box] += 1
        assert tuple(s) == (tuple(v.shape)[::-1] if m.transposed else tuple(v.shape))
    assert bool((covered == 1).all())  # every element in exactly one matrix
    assert parse(m.plain()) == m and m.plain()["interleaved"] is True


def test_an_interleaved_map_differs_from_the_side_by_side_one():
    side, strided = parse({"split": [2, 2]}), parse({"split": [2, 2], "interleaved": True})
    assert side != strided and side.plain() == {"split": [2, 2]}
    t = torch.arange(8.0).view(4, 2)
    assert [v[:, 0].tolist() for v in strided.views(t)] == [[0.0, 4.0], [2.0, 6.0]]
    assert [v[:, 0].tolist() for v in side.views(t)] == [[0.0, 2.0], [4.0, 6.0]]


# ----- the optimizers against the de-interleaved references ---------------------------------------
@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw", "spectral_unclamped"])
def test_muon_matches_the_deinterleaved_reference(foreach, adjust_lr_fn):
    names, params, specs = layout_params()
    grads = make_grads(params, steps=3)
    ref = deinterleaved_reference(
        muon_reference_pieces, names, params, grads, adjust_lr_fn=adjust_lr_fn, **MUON_HP
    )
    ours = clone_params(params)
    opt = Muon(
        [{"params": ours, "matrices": specs}],
        ns_dtype=F32,
        adjust_lr_fn=adjust_lr_fn,
        foreach=foreach,
        **MUON_HP,
    )
    run_checking_grads_untouched(opt, ours, grads)
    for name, p, r in zip(names, ours, ref):
        assert rel_err(p.detach(), r) < 1e-5, name
    if foreach is None:
        assert opt.plan().num_matrices == sum(len(LAYOUTS[n][4]) for n in names)


@pytest.mark.parametrize("policy", ["auto", "min_launches", "exact"])
def test_musgd_matches_the_deinterleaved_reference(policy):
    names, params, specs = layout_params()
    grads = make_grads(params, steps=3)
    ref = deinterleaved_reference(musgd_reference_pieces, names, params, grads, **MUSGD_HP)
    ours = clone_params(params)
    opt = MuSGD(
        [{"params": ours, "use_muon": True, "matrices": specs}], ns_dtype=F32, policy=policy, **MUSGD_HP
    )
    run_checking_grads_untouched(opt, ours, grads)
    for name, p, r in zip(names, ours, ref):
        assert rel_err(p.detach(), r) < 1e-5, name


VARIANTS = {
    "normuon": (fastmuon.NorMuon, {}, dict(variant="normuon", nesterov=True)),
    "adamuon": (fastmuon.AdaMuon, {}, dict(variant="adamuon", nesterov=False, sign_momentum=True)),
}


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("foreach", [None, False])
def test_second_moment_variants_keep_statistics_per_interleaved_part(name, foreach):
    cls, kwargs, ref_kw = VARIANTS[name]
    names, params, specs = layout_params()
    grads = make_grads(params, steps=3)
    hp = dict(lr=0.02, momentum=0.95, weight_decay=0.1)

    def step(p, g, state, pieces, **kw):
        variant_reference_step(p, g, state, pieces=pieces, **kw)

    ref = deinterleaved_reference(step, names, params, grads, **hp, **ref_kw)
    ours = clone_params(params)
    opt = cls(
        [{"params": ours, "matrices": specs}],
        ns_dtype=F32,
        ns_method="standard",
        foreach=foreach,
        **hp,
        **kwargs,
    )
    run_checking_grads_untouched(opt, ours, grads)
    for n, p, r in zip(names, ours, ref):
        assert rel_err(p.detach(), r) < 2e-5, n
    if name == "normuon":  # one entry per neuron of each part: GPT-OSS's 3 experts × (6 + 6) outputs
        assert opt.state[ours[0]]["second_moment"].shape == (36,)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    ],
)
def test_interleaved_step_on_the_device_matches_the_deinterleaved_reference(device):
    """On a GPU the engine packs the strided parts itself (no NS input views)."""
    names, params, specs = layout_params(["gpt_oss", "rows", "conv1d_qkv", "conv"])
    grads = make_grads(params, steps=2)
    ref = deinterleaved_reference(muon_reference_pieces, names, params, grads, **MUON_HP)
    ours = [nn.Parameter(p.detach().to(device)) for p in params]
    opt = Muon([{"params": ours, "matrices": specs}], ns_dtype=F32, **MUON_HP)
    for step in grads:
        for p, g in zip(ours, step):
            p.grad = g.to(device)
        opt.step()
    for name, p, r in zip(names, ours, ref):
        assert rel_err(p.detach().cpu(), r) < (1e-5 if device == "cpu" else 1e-4), name


@pytest.mark.parametrize("cls, hp", [(Muon, MUON_HP), (MuSGD, MUSGD_HP)])
def test_a_capturable_step_on_interleaved_parts_makes_no_host_sync(cls, hp):
    from fastmuon.bench.hosttime import host_syncs

    _, params, specs = layout_params(["gpt_oss", "columns"])
    opt = cls(
        [{"params": params, "use_muon": True, "matrices": specs}],
        capturable=True,
        nonfinite="skip",
        lr=torch.tensor(hp["lr"]),
        **{k: v for k, v in hp.items() if k != "lr"},
    )
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # builds the step program
    assert host_syncs(opt.step) == {}


def test_a_nonfinite_gradient_in_one_interleaved_part_skips_the_tensor_and_spares_the_others():
    names, params, specs = layout_params(["gpt_oss", "rows"])
    grads = make_grads(params, steps=2)
    ref = deinterleaved_reference(
        muon_reference_pieces, names[1:], params[1:], [g[1:] for g in grads], **MUON_HP
    )
    opt = Muon([{"params": params, "matrices": specs}], ns_dtype=F32, nonfinite="skip", **MUON_HP)
    w = params[0]
    before = w.detach().clone()
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        w.grad[1, 0, 3] = float("nan")  # an "up" column of expert 1
        opt.step()
    assert torch.equal(w.detach(), before)
    assert torch.equal(opt.state[w]["momentum_buffer"], torch.zeros_like(w))
    assert rel_err(params[1].detach(), ref[0]) < 1e-5


def test_orthogonalize_and_newton_schulz_take_interleaved_maps():
    for name, (shape, spec, dim, n, pieces) in LAYOUTS.items():
        x = torch.randn(shape)
        want = torch.zeros(shape)
        apart = deinterleaved(x, dim, n)
        for box, transposed in pieces:
            u = apart[box].T if transposed else apart[box]
            o = ns_reference(u.reshape(u.shape[0], -1)).reshape(u.shape)
            want[box] = o.T if transposed else o
        want = interleaved(want, dim, n)
        (got,) = orthogonalize([x], dtype=F32, matrices=spec)
        assert rel_err(got, want) < 1e-5, name
        assert rel_err(newton_schulz(x, dtype=F32, matrices=spec), want) < 1e-5, name


def test_a_state_dict_keeps_the_interleaved_map_and_resumes_exactly():
    names, params, specs = layout_params(["gpt_oss", "rows"])
    grads = make_grads(params, steps=4)
    a = clone_params(params)
    opt_a = Muon([{"params": a, "matrices": specs}], ns_dtype=F32, **MUON_HP)
    for step in grads[:2]:
        for p, g in zip(a, step):
            p.grad = g.clone()
        opt_a.step()
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert saved["param_groups"][0]["matrices"] == specs
    b = clone_params(a)
    opt_b = Muon(b, ns_dtype=F32, **MUON_HP)
    opt_b.load_state_dict(saved)
    for step in grads[2:]:
        for pa, pb, g in zip(a, b, step):
            pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    assert all(torch.equal(pa, pb) for pa, pb in zip(a, b))


# ----- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, shape, words",
    [
        # malformed maps name their group; a map that does not fit a tensor names the parameter
        ({"interleaved": True}, (6, 10), ["'split' or 'heads'", "param group"]),
        ({"split": [3, 3], "interleaved": 1}, (6, 10), ["True or False", "param group"]),
        (
            {"split": [2, 4], "interleaved": True},
            (6, 10),
            ["equal sizes", "drop 'interleaved'", "param group"],
        ),
        ({"split": [3, 3], "interleaved": True}, (7, 10), ["2 does not divide 7", "shape (7, 10)"]),
        ({"heads": 4, "interleaved": True}, (6, 10), ["4 does not divide 6", "shape (6, 10)"]),
        (
            {"split": [2, 2], "interleaved": True},
            (6, 10),
            ["split is [2, 2]", "give split [3, 3]", "shape (6, 10)"],
        ),
        (
            {"batch_dims": 1, "split": [3, 3], "interleaved": True, "transposed": True},
            (2, 4, 7),
            ["dim 2 (size 7;", "2 does not divide 7", "shape (2, 4, 7)"],
        ),
    ],
)
def test_bad_interleaved_maps_are_refused_naming_the_parameter_and_the_fix(spec, shape, words):
    (w,) = make_params([shape])
    opt = Muon(make_params([(3, 3)]), **MUON_HP)
    before = repr(opt.param_groups), opt.state_dict()
    with pytest.raises(ValueError) as info:
        opt.add_param_group({"params": [w], "matrices": spec})
    message = str(info.value)
    assert all(word in message for word in words), message
    assert repr(opt.param_groups) == before[0] and opt.state_dict() == before[1]  # as it was
    with pytest.raises(ValueError) as info:
        Muon([("blocks.0.experts.gate_up_proj", w)], matrices=spec, **MUON_HP)
    if "param group" not in words:
        assert "'blocks.0.experts.gate_up_proj'" in str(info.value)


def test_a_map_set_on_a_group_later_is_refused_at_the_step_and_changes_nothing():
    (w,) = ours = make_params([(7, 4)])
    opt = Muon([{"params": ours}], ns_dtype=F32, **MUON_HP)
    w.grad = torch.randn_like(w)
    opt.step()
    before = w.detach().clone(), opt.state[w]["momentum_buffer"].clone()
    opt.param_groups[0]["matrices"] = {"split": [3, 4], "interleaved": True}
    with pytest.raises(ValueError, match="equal sizes"):
        opt.step()
    opt.param_groups[0]["matrices"] = {"heads": 2, "interleaved": True}
    with pytest.raises(ValueError, match="2 does not divide 7"):
        opt.step()
    assert torch.equal(w.detach(), before[0]) and torch.equal(opt.state[w]["momentum_buffer"], before[1])


# ----- recognised by param_groups from a layer's flags --------------------------------------------
class FlaggedExperts(nn.Module):
    """Fused experts carrying Transformers' ``use_experts_implementation`` flags."""

    def __init__(
        self, transposed: bool, concatenated: bool, experts: int = 2, hidden: int = 6, inter: int = 4
    ):
        super().__init__()
        self.is_transposed, self.is_concatenated, self.has_gate = transposed, concatenated, True
        gate_up = (experts, hidden, 2 * inter) if transposed else (experts, 2 * inter, hidden)
        down = (experts, inter, hidden) if transposed else (experts, hidden, inter)
        self.gate_up_proj = nn.Parameter(torch.randn(gate_up))
        self.down_proj = nn.Parameter(torch.randn(down))


class Block(nn.Module):
    def __init__(self, experts: nn.Module):
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.experts = experts


@pytest.mark.parametrize(
    "transposed, concatenated, want",
    [
        (True, False, {"batch_dims": 1, "split": [4, 4], "interleaved": True, "transposed": True}),
        (False, False, {"batch_dims": 1, "split": [4, 4], "interleaved": True}),
        (False, True, {"batch_dims": 1, "split": [4, 4]}),
    ],
)
def test_fused_experts_flagged_not_concatenated_get_interleaved_parts(transposed, concatenated, want):
    model = Block(FlaggedExperts(transposed, concatenated))
    (muon,) = [g for g in param_groups(model, head=None) if g["use_muon"]]
    maps = dict(zip(muon["param_names"], muon["matrices"]))
    assert maps["experts.gate_up_proj"] == want
    assert maps["experts.down_proj"] == ({"batch_dims": 1, "transposed": True} if transposed else "experts")


def test_an_odd_gate_up_width_stays_one_matrix_per_expert():
    model = Block(FlaggedExperts(True, False))
    model.experts.gate_up_proj = nn.Parameter(torch.randn(2, 6, 7))
    (muon,) = [g for g in param_groups(model, head=None) if g["use_muon"]]
    maps = dict(zip(muon["param_names"], muon["matrices"]))
    assert maps["experts.gate_up_proj"] == {"batch_dims": 1, "transposed": True}


@pytest.fixture(scope="module")
def transformers(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        yield import_offline(mp, "transformers", str(tmp_path_factory.mktemp("hf_home")))


def test_muon_on_a_tiny_gpt_oss_steps_gate_and_up_like_the_deinterleaved_reference(transformers):
    """A training step of Transformers' GPT-OSS with ``param_groups``' groups: each expert's gate
    (columns 0::2 of ``gate_up_proj``) and up (1::2) orthogonalised apart, as the reference does
    on the de-interleaved tensor."""
    hidden, inter, experts = 16, 8, 3
    config = transformers.GptOssConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_local_experts=experts,
        num_experts_per_tok=2,
        vocab_size=50,
    )
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    groups = param_groups(model)
    (muon,) = [g for g in groups if g["use_muon"]]
    names = muon["param_names"]
    gate_up = names.index("model.layers.0.mlp.experts.gate_up_proj")
    assert parse(muon["matrices"][gate_up]).interleaved
    ids = torch.randint(0, 50, (2, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    p = muon["params"][gate_up]
    assert p.grad is not None and p.grad.abs().sum() > 0
    hp = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
    ref = deinterleaved(p.detach(), 2, 2)
    pieces = [((e, ALL, slice(a, a + inter)), True) for e in range(experts) for a in (0, inter)]
    muon_reference_pieces(ref, deinterleaved(p.grad, 2, 2), {}, pieces, **hp)
    opt = Muon(groups, ns_dtype=F32, **hp)
    opt.step()
    assert rel_err(p.detach(), interleaved(ref, 2, 2)) < 1e-5
    assert opt.plan().num_matrices == sum(
        count(q.shape, parse(m)) for q, m in zip(muon["params"], muon["matrices"])
    )


def test_param_groups_takes_an_interleaved_map_by_name_and_names_a_bad_one():
    model = nn.Sequential(nn.Linear(5, 12), nn.Linear(12, 5))
    groups = param_groups(model, head=None, matrices={"0.weight": {"split": [6, 6], "interleaved": True}})
    (muon,) = [g for g in groups if g["use_muon"]]
    assert muon["matrices"][muon["param_names"].index("0.weight")] == {"split": [6, 6], "interleaved": True}
    with pytest.raises(ValueError, match=r"0\.weight.*5 does not divide 12|5 does not divide 12.*0\.weight"):
        param_groups(model, head=None, matrices={"0.weight": {"heads": 5, "interleaved": True}})


# ----- held in parts across ranks ----------------------------------------------------------------
@st.composite
def sharded_interleaved(draw):
    """A 3-D tensor, each rank's box (a grid of blocks over dims 0 and 1 with replicas, as any
    mix of ``Shard`` and ``Replicate`` leaves them) and an interleaved map over dim 0, 1 or 2."""
    spec = draw(
        st.sampled_from(
            [
                {"heads": 2, "interleaved": True},  # dim 0 of (d0, d1·d2)
                {"heads": 3, "interleaved": True},
                {"batch_dims": 1, "heads": 2, "interleaved": True},  # dim 1, per expert
                {"batch_dims": 1, "heads": 2, "interleaved": True, "transposed": True},  # dim 2
                {"batch_dims": 1, "heads": 3, "dim": 1, "interleaved": True},  # dim 2
            ]
        )
    )
    m = parse(spec)
    parts = len(m.part_sizes((6, 6, 6)))
    shape = [draw(st.integers(1, 5)), draw(st.integers(1, 5)), draw(st.integers(1, 2))]
    shape[m.stored_dim()] = parts * draw(st.integers(1, 3))
    rows, cols = cuts(draw, shape[0], 3), cuts(draw, shape[1], 3)
    regions = []
    for _ in range(draw(st.integers(1, 2))):
        for (a, b), (c, d) in itertools.product(rows, cols):
            regions.append(((a, b), (c, d), (0, shape[2])) if a < b and c < d else None)
    return tuple(shape), tuple(regions), m


def cuts(draw, size: int, most: int) -> list[tuple[int, int]]:
    """``size`` cut into at most ``most`` ranges (some maybe empty, as uneven shards leave them)."""
    k = draw(st.integers(1, most))
    points = sorted(draw(st.lists(st.integers(0, size), min_size=k - 1, max_size=k - 1)))
    bounds = [0, *points, size]
    return list(zip(bounds, bounds[1:]))


def held_by_mask(whole: torch.Tensor, box, region):
    """The part of ``whole[box]`` inside ``region``, in the matrix's coordinates, found by
    marking the region's elements and reading the mark through the box: None where it holds
    none; it must be a box of the matrix."""
    if region is None:
        return None
    mark = torch.zeros(whole.shape, dtype=torch.bool)
    mark[tuple(slice(a, b) for a, b in region)] = True
    inside = mark[box]
    if not inside.any():
        return None
    where = inside.nonzero()
    bounds = tuple((int(lo), int(hi) + 1) for lo, hi in zip(where.min(0).values, where.max(0).values))
    assert inside[tuple(slice(a, b) for a, b in bounds)].all(), "a rank's part of a matrix is a box of it"
    assert int(inside.sum()) == math.prod(b - a for a, b in bounds)
    return bounds


@settings(max_examples=120, deadline=None)
@given(sharded_interleaved())
def test_each_rank_views_its_part_of_every_interleaved_matrix(case):
    shape, regions, m = case
    m.check(shape)
    whole = torch.arange(math.prod(shape), dtype=F32).reshape(shape)
    for rank, region in enumerate(regions):
        index = tuple(slice(a, b) for a, b in region) if region else tuple(slice(0, 0) for _ in shape)
        t = whole[index]  # this rank's local tensor
        pieces = iter(held_pieces(m, t, t, t, Parts(shape, regions, rank)))
        for box in m.boxes(shape):
            matrix = whole[box]
            held = tuple(held_by_mask(whole, box, r) for r in regions)
            holders = [h for h in held if h is not None]
            alone = len(holders) == 1 and holders[0] == whole_region(matrix.shape)
            if held[rank] is None and alone:
                continue  # another rank's alone: not in this rank's list
            piece = next(pieces)
            view, described = piece.param, piece.whole
            assert described is not None
            assert described.shape == tuple(matrix.shape) and described.held == held
            assert described.exchanged == (not alone)
            if held[rank] is None:
                assert view.numel() == 0
            else:
                assert torch.equal(view, matrix[tuple(slice(a, b) for a, b in held[rank])])
                assert view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()  # a view
        assert next(pieces, None) is None, "a matrix the rank should not hold"


def test_the_scale_figures_count_an_interleaved_part_as_the_ranks_hold_it():
    """``fastmuon plan``'s array arithmetic (scale/figures.py) finds every interleaved
    matrix's parts and their holders as marking each rank's box and reading it through the
    matrix's box does, under FSDP, FSDP + TP and expert parallelism."""
    tensors = (
        ScaleTensor("e.gate_up_proj", (4, 6, 10), LAYOUTS["gpt_oss"][1], experts=True),
        ScaleTensor("a.qkv", (12, 6), {"split": [4, 4, 4], "interleaved": True}, tp=COLWISE),
        ScaleTensor("a.cols", (6, 12), {"heads": 3, "dim": 1, "interleaved": True}, tp=ROWWISE),
    )
    workload = Workload("interleaved", "by hand", tensors)
    for spec, world in (("fsdp", 3), ("fsdp+tp:2x2", 4), ("ep:2", 4)):
        layout = parse_layout(spec, world, workload.num_experts)
        figures = iter(scale_matrices(workload, layout))
        for tensor in tensors:
            whole = torch.zeros(tensor.shape)
            boxes = rank_regions(layout, tensor)
            for box in parse(tensor.map).boxes(tensor.shape):
                holders: dict = {}
                for r, region in enumerate(boxes):
                    part = held_by_mask(whole, box, region)
                    if part is not None:
                        holders.setdefault(part, []).append(r)
                fig = next(figures)
                assert fig.shape == tuple(whole[box].shape), (spec, tensor.name)
                got = sorted(zip(fig.part_numel.tolist(), (sorted(r.tolist()) for r in fig.part_ranks)))
                want = sorted((math.prod(b - a for a, b in part), ranks) for part, ranks in holders.items())
                assert got == want, (spec, tensor.name, box)
        assert next(figures, None) is None


# ----- the bench workload ------------------------------------------------------------------------
TINY_GPT_OSS = Generated(
    functools.partial(gpt_oss_like_decoder, layers=2, vocab=64, d=32, heads=4, kv_heads=2, experts=3, ffn=16),
    "a small GPT-OSS-like decoder",
    gpt_oss_like_groups,
)


def test_the_gpt_oss_like_workload_has_granite_moes_matrices_interleaved():
    ours, theirs = resolve_workload("gpt-oss-like"), resolve_workload("granite-moe")
    specs = {p.name: (p.shape, spec) for p, spec in zip(ours.params, ours.map_specs())}
    experts = "model.layers.0.mlp.experts"
    assert specs[f"{experts}.gate_up_proj"] == (
        (32, 1024, 1024),
        {"batch_dims": 1, "split": [512, 512], "interleaved": True, "transposed": True},
    )
    assert specs[f"{experts}.down_proj"] == ((32, 512, 1024), {"batch_dims": 1, "transposed": True})
    assert ours.ns_matrices() == theirs.ns_matrices() == 4 + 1 + 2 * 32 + 32
    assert "groups and matrix maps written out" in ours.source

    def matrix_shapes(manifest):  # (out, in) of every matrix the maps make
        return sorted(s for p, m in zip(manifest.matrices(), manifest.maps()) for s in m.shapes(p.shape))

    assert matrix_shapes(ours) == matrix_shapes(theirs)


@pytest.mark.parametrize("optimizer", ["muon", "musgd"])
def test_every_bench_contender_steps_the_same_interleaved_matrices(optimizer):
    """fastmuon with the maps, its per-matrix loop, and a peer given each gate and up as a 2-D
    strided view take the same step (fp32 NS everywhere)."""
    m = manifest_of(TINY_GPT_OSS, "tiny")
    assert m.ns_matrices() == 2 * (5 + 2 * 3 + 3)
    peer = torch_muon_fp32_contender if optimizer == "muon" else ultralytics_fp32_contender
    steps = {}
    for factory in (fastmuon_contender, reference_contender, peer):
        params = materialize(m, torch.device("cpu"), 0)
        wb = Workbench(m, params, torch.device("cpu"), optimizer, F32, "auto", fastmuon=CLASSES[optimizer])
        before = [p.detach().clone() for p in wb.params]
        try:
            contender = factory(wb)
        except Unavailable as e:  # not installed here, or its fp32 row not shown on this CPU
            assert factory is peer, e
            continue
        contender.step()
        steps[factory] = torch.cat([(p.detach() - b).flatten() for p, b in zip(wb.params, before)])
    ours = steps[fastmuon_contender]
    assert ours.abs().sum() > 0 and len(steps) >= 2
    for factory, step in steps.items():
        assert rel_err(step, ours) <= 1e-5, factory.__name__
