"""Matrix maps: tensors that hold several matrices (MoE expert stacks, fused QKV, GPT-2's
transposed Conv1D, per-head slices) are orthogonalised matrix by matrix.

Every layout is checked against the per-matrix fp32 reference in ``reference_impl.py``, whose
pieces are written out by hand here (index and orientation), not taken from fastmuon.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from conftest import rel_err
from helpers import clone_params, make_grads, make_params, run_checking_grads_untouched, run_pieces_reference
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_impl import muon_reference_pieces, musgd_reference_pieces, ns_reference

from fastmuon import Muon, MuSGD, newton_schulz, orthogonalize
from fastmuon.ns.matrices import MatrixMap, count, parse

OPTIMIZERS = [MuSGD, Muon]

ALL = slice(None)

# (shape, spec, the matrices by hand: (index into the tensor, stored (in, out)?))
LAYOUTS = {
    "experts": ((4, 6, 10), "experts", [((e,), False) for e in range(4)]),
    "gate_up": (
        (3, 8, 6),
        {"batch_dims": 1, "split": [4, 4]},
        [((e, slice(a, a + 4)), False) for e in range(3) for a in (0, 4)],
    ),
    "conv1d_qkv": (
        (6, 18),
        {"split": [6, 6, 6], "transposed": True},
        [((ALL, slice(a, a + 6)), True) for a in (0, 6, 12)],
    ),
    "conv1d_mlp": ((6, 24), "transposed", [((), True)]),
    "in_proj": ((15, 5), {"split": [5, 5, 5]}, [((slice(a, a + 5),), False) for a in (0, 5, 10)]),
    "heads_rows": ((8, 12), {"heads": 4}, [((slice(a, a + 2),), False) for a in range(0, 8, 2)]),
    "heads_cols": ((6, 12), {"heads": 3, "dim": 1}, [((ALL, slice(a, a + 4)), False) for a in (0, 4, 8)]),
    "uneven_split": ((9, 7), {"split": [2, 7]}, [((slice(0, 2),), False), ((slice(2, 9),), False)]),
    "two_batch_dims": (
        (2, 3, 5, 4),
        {"batch_dims": 2},
        [((i, j), False) for i in range(2) for j in range(3)],
    ),
    "conv_flatten": ((8, 4, 3, 3), "flatten", [((), False)]),
}

MUON_HP = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
MUSGD_HP = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2, muon=0.3, sgd=0.7)


def _layout_params(names):
    params = make_params([LAYOUTS[n][0] for n in names])
    return params, [LAYOUTS[n][1] for n in names], [LAYOUTS[n][2] for n in names]


@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw", "spectral_unclamped"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_per_matrix_reference(foreach, adjust_lr_fn, nesterov):
    names = list(LAYOUTS)
    params, specs, pieces = _layout_params(names)
    grads = make_grads(params, steps=3)
    hp = {**MUON_HP, "nesterov": nesterov}
    ref = run_pieces_reference(muon_reference_pieces, params, grads, pieces, adjust_lr_fn=adjust_lr_fn, **hp)
    ours = clone_params(params)
    opt = Muon(
        [{"params": ours, "use_muon": True, "matrices": specs}],
        ns_dtype=torch.float32,
        adjust_lr_fn=adjust_lr_fn,
        foreach=foreach,
        **hp,
    )
    run_checking_grads_untouched(opt, ours, grads)
    for name, p, r in zip(names, ours, ref):
        assert rel_err(p.detach(), r) < 1e-5, name


@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("adjust_lr", ["ultralytics", "original"])
def test_musgd_matches_per_matrix_reference(foreach, adjust_lr):
    names = list(LAYOUTS)
    params, specs, pieces = _layout_params(names)
    grads = make_grads(params, steps=3)
    ref = run_pieces_reference(musgd_reference_pieces, params, grads, pieces, adjust_lr=adjust_lr, **MUSGD_HP)
    ours = clone_params(params)
    opt = MuSGD(
        [{"params": ours, "use_muon": True, "matrices": specs}],
        ns_dtype=torch.float32,
        adjust_lr=adjust_lr,
        foreach=foreach,
        **MUSGD_HP,
    )
    run_checking_grads_untouched(opt, ours, grads)
    for name, p, r in zip(names, ours, ref):
        assert rel_err(p.detach(), r) < 1e-5, name


def test_one_map_for_a_whole_group_and_the_constructor_default():
    params = make_params([(4, 6, 10), (2, 5, 5)])
    grads = make_grads(params, steps=2)
    ref = [p.detach().clone() for p in params]
    states = [{} for _ in params]
    for step in grads:
        for q, g, st_ in zip(ref, step, states):
            muon_reference_pieces(q, g, st_, [((e,), False) for e in range(q.shape[0])], **MUON_HP)
    for groups, kw in (
        ([{"params": None, "matrices": "experts"}], {}),
        ([{"params": None}], {"matrices": "experts"}),
    ):
        ours = clone_params(params)
        groups[0]["params"] = ours
        opt = Muon(groups, ns_dtype=torch.float32, **kw, **MUON_HP)
        run_checking_grads_untouched(opt, ours, grads)
        assert all(rel_err(p.detach(), r) < 1e-5 for p, r in zip(ours, ref))


def test_experts_are_batched_as_separate_matrices():
    (w,) = ours = make_params([(8, 16, 32)])
    opt = Muon([{"params": ours, "matrices": "experts"}], ns_dtype=torch.float32, policy="exact", **MUON_HP)
    w.grad = torch.randn_like(w)
    opt.step()
    plan = opt.plan()
    assert plan.num_matrices == 8
    assert [b.shape for b in plan.buckets] == [(8, 16, 32)]


def test_changing_a_groups_map_rebuilds_the_step():
    (w,) = ours = make_params([(4, 6, 10)])
    opt = Muon(ours, ns_dtype=torch.float32, **MUON_HP)
    w.grad = torch.randn_like(w)
    opt.step()
    assert opt.plan().num_matrices == 1
    opt.param_groups[0]["matrices"] = "experts"
    opt.step()
    assert opt.plan().num_matrices == 4


def test_state_dict_round_trip_keeps_maps_and_resumes_exactly():
    params, specs, _ = _layout_params(["gate_up", "conv1d_qkv", "experts"])
    grads = make_grads(params, steps=4)
    a = clone_params(params)
    opt_a = Muon([{"params": a, "matrices": specs}], ns_dtype=torch.float32, **MUON_HP)
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
    opt_b = Muon(b, ns_dtype=torch.float32, **MUON_HP)  # flatten until the state dict says otherwise
    opt_b.load_state_dict(saved)
    for step in grads[2:]:
        for pa, pb, g in zip(a, b, step):
            pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    assert all(torch.equal(pa, pb) for pa, pb in zip(a, b))


def test_loading_a_torch_muon_state_keeps_our_maps():
    (w,) = make_params([(6, 10)])
    theirs = torch.optim.Muon([w], lr=0.02)
    w.grad = torch.randn_like(w)
    theirs.step()
    q = clone_params([w])
    ours = Muon([{"params": q, "matrices": {"split": [3, 3]}}], **MUON_HP)
    ours.load_state_dict(theirs.state_dict())
    assert ours.param_groups[0]["matrices"] == {"split": [3, 3]}


@pytest.mark.parametrize(
    "spec, shape, words",
    [
        # a malformed map names its group; one that does not fit a tensor names the parameter
        ("expert", (4, 6, 10), ["unknown matrix map", "experts", "param group"]),
        ({"batch": 1}, (4, 6, 10), ["unknown key", "batch_dims", "param group"]),
        ({"split": [3, 3], "heads": 2}, (6, 10), ["not both", "param group"]),
        ({"dim": 1}, (6, 10), ["give one of them", "param group"]),
        ({"split": [6, -0]}, (6, 10), ["positive ints", "param group"]),
        ({"split": [3, 4]}, (6, 10), ["add up to 7", "sum to 6", "shape (6, 10)"]),
        ({"heads": 4}, (6, 10), ["does not divide", "shape (6, 10)"]),
        ("experts", (6, 10), ["at least 3 dims", "shape (6, 10)"]),
        ({"batch_dims": 1, "transposed": True}, (2, 4, 3, 3), ["not 2-D", "shape (2, 4, 3, 3)"]),
    ],
)
def test_bad_maps_are_refused_naming_the_parameter(spec, shape, words):
    (w,) = make_params([shape])
    opt = Muon(make_params([(3, 3)]), **MUON_HP)
    before = repr(opt.param_groups)
    with pytest.raises(ValueError) as info:
        opt.add_param_group({"params": [w], "matrices": spec})
    message = str(info.value)
    assert all(word in message for word in words), message
    assert repr(opt.param_groups) == before  # a refused group leaves the optimizer as it was
    with pytest.raises(ValueError) as info:
        Muon([("blocks.0.experts", w)], matrices=spec, **MUON_HP)
    if "param group" not in words:
        assert "'blocks.0.experts'" in str(info.value)


def test_a_list_of_maps_must_have_one_per_parameter():
    params = make_params([(4, 6, 10), (6, 6)])
    with pytest.raises(ValueError, match="one per parameter"):
        Muon([{"params": params, "matrices": ["experts"]}], **MUON_HP)


def test_maps_are_ignored_for_parameters_that_are_not_matrices():
    w, b = make_params([(4, 6, 10), (6,)])
    opt = MuSGD([{"params": [w, b], "use_muon": True, "matrices": "experts"}], **MUSGD_HP)
    w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
    opt.step()
    assert opt.plan().num_matrices == 4


def test_a_nonfinite_expert_gradient_is_skipped_whole():
    (w,) = ours = make_params([(4, 6, 10)])
    opt = Muon([{"params": ours, "matrices": "experts"}], nonfinite="skip", **MUON_HP)
    w.grad = torch.randn_like(w)
    opt.step()
    before = w.detach().clone(), opt.state[w]["momentum_buffer"].clone()
    w.grad = torch.randn_like(w)
    w.grad[2, 0, 0] = float("nan")
    opt.step()
    assert torch.equal(w.detach(), before[0]) and torch.equal(opt.state[w]["momentum_buffer"], before[1])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_orthogonalize_and_newton_schulz_take_maps(name):
    shape, spec, pieces = LAYOUTS[name]
    x = torch.randn(shape)
    want = torch.zeros(shape)
    for box, transposed in pieces:
        u = x[box].T if transposed else x[box]
        o = ns_reference(u.reshape(u.shape[0], -1)).reshape(u.shape)
        want[box] = o.T if transposed else o
    (got,) = orthogonalize([x], dtype=torch.float32, matrices=spec)
    assert rel_err(got, want) < 1e-5
    assert rel_err(newton_schulz(x, dtype=torch.float32, matrices=spec), want) < 1e-5


def test_orthogonalize_names_the_tensor_a_map_does_not_fit():
    with pytest.raises(ValueError, match="tensor 1"):
        orthogonalize([torch.randn(4, 4), torch.randn(6, 10)], matrices=[None, {"split": [4, 4]}])


# ----- the maps' geometry ---------------------------------------------------------------------
@st.composite
def shapes_and_maps(draw):
    batch_dims = draw(st.integers(0, 2))
    batch = draw(st.lists(st.integers(1, 3), min_size=batch_dims, max_size=batch_dims))
    transposed = draw(st.booleans())
    matrix = draw(st.lists(st.integers(1, 6), min_size=2, max_size=2 if transposed else 3))
    shape = (*batch, *matrix)
    spec: dict = {"batch_dims": batch_dims, "transposed": transposed}
    cut = draw(st.sampled_from(["none", "split", "heads"]))
    if cut != "none":
        dim = draw(st.integers(0, 1))
        stored = batch_dims + (1 - dim if transposed else dim)
        size = shape[stored]
        spec["dim"] = dim
        if cut == "heads":
            spec["heads"] = draw(st.sampled_from([h for h in range(1, size + 1) if size % h == 0]))
        else:
            parts, left = [], size
            while left:
                parts.append(draw(st.integers(1, left)))
                left -= parts[-1]
            spec["split"] = parts
    return shape, spec


@settings(max_examples=150, deadline=None)
@given(shapes_and_maps())
def test_views_are_the_boxes_and_shapes_are_out_by_in(case):
    shape, spec = case
    m = parse(spec)
    m.check(shape)
    t = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    views, boxes, shapes = m.views(t), m.boxes(shape), m.shapes(shape)
    assert len(views) == len(boxes) == len(shapes) == count(shape, m)
    covered = torch.zeros(shape, dtype=torch.int64)
    for v, box, s in zip(views, boxes, shapes):
        assert torch.equal(v, t[box]) and v.data_ptr() == t[box].data_ptr()  # views, not copies
        covered[box] += 1
        assert tuple(s) == (tuple(v.shape)[::-1] if m.transposed else tuple(v.shape))
    assert bool((covered == 1).all()) or m.is_flatten  # every element in exactly one matrix
    assert parse(m.plain()) == m


def test_shorthands_round_trip():
    for name in ("flatten", "experts", "transposed"):
        assert parse(name).plain() == name
    assert parse(None) == MatrixMap()


@pytest.mark.parametrize("cls, hp", [(Muon, MUON_HP), (MuSGD, MUSGD_HP)])
def test_a_capturable_step_on_mapped_tensors_makes_no_host_sync(cls, hp):
    from fastmuon.bench.hosttime import host_syncs

    params, specs, _ = _layout_params(["gate_up", "conv1d_qkv", "heads_cols"])
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


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    ],
)
def test_mapped_step_on_the_device_matches_the_per_matrix_reference(device):
    """Mapped tensors on each device (on a GPU the engine packs there: no NS input views)."""
    names = ["gate_up", "conv1d_qkv", "heads_cols", "experts"]
    params, specs, pieces = _layout_params(names)
    grads = make_grads(params, steps=2)
    ref = [p.detach().clone() for p in params]
    states = [{} for _ in params]
    for step in grads:
        for q, g, st_, pcs in zip(ref, step, states, pieces):
            muon_reference_pieces(q, g, st_, pcs, **MUON_HP)
    ours = [torch.nn.Parameter(p.detach().to(device)) for p in params]
    opt = Muon([{"params": ours, "matrices": specs}], ns_dtype=torch.float32, **MUON_HP)
    for step in grads:
        for p, g in zip(ours, step):
            p.grad = g.to(device)
        opt.step()
    for name, p, r in zip(names, ours, ref):
        assert rel_err(p.detach().cpu(), r) < (1e-5 if device == "cpu" else 1e-4), name


@pytest.mark.parametrize(
    "good, bad",
    [
        ({"heads": 2}, {"heads": 2.0}),
        ({"batch_dims": 1}, {"batch_dims": True}),
        ({"split": [4, 4]}, {"split": [4.0, 4.0]}),
        ({"transposed": True}, {"transposed": 1}),
        ({"split": [4, 4], "dim": 1}, {"split": [4, 4], "dim": 1.0}),
    ],
)
@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_a_map_is_refused_whatever_equal_map_was_parsed_before(cls, good, bad):
    shape = (2, 8, 8) if "batch_dims" in good else (8, 8)
    cls([{"params": [torch.nn.Parameter(torch.randn(shape))], "matrices": good, "use_muon": True}])
    with pytest.raises(ValueError, match="of a matrix map must be"):
        cls([{"params": [torch.nn.Parameter(torch.randn(shape))], "matrices": bad, "use_muon": True}])


@pytest.mark.parametrize(
    "shape, edited",
    [
        ((6, 10), "experts"),
        ((4, 5, 6), {"batch_dims": 2}),
        ((8, 3, 3, 3), "transposed"),
        ((6, 10), {"heads": 4}),
    ],
)
@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_a_map_set_on_a_group_after_construction_is_checked_by_the_next_step(cls, foreach, shape, edited):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(shape))
    twin = torch.nn.Parameter(p.detach().clone())
    opt, reference = _build(cls, p, foreach), _build(cls, twin, foreach)
    grads = [torch.randn(shape) for _ in range(3)]
    p.grad, twin.grad = grads[0].clone(), grads[0].clone()
    opt.step()
    reference.step()
    before = copy.deepcopy(opt.state_dict())
    weights = p.detach().clone()
    opt.param_groups[0]["matrices"] = edited
    p.grad = grads[1].clone()
    with pytest.raises(ValueError, match=r"parameter 0 of param group 0 \(shape .*matrix map"):
        opt.step()
    assert torch.equal(p, weights)
    assert str(opt.state_dict()["state"]) == str(before["state"])
    # put back, it steps on as an optimizer that never saw the edit
    opt.param_groups[0]["matrices"] = "flatten"
    for grad in grads[1:]:
        p.grad, twin.grad = grad.clone(), grad.clone()
        opt.step()
        reference.step()
    torch.testing.assert_close(p, twin, rtol=0, atol=0)


def _build(cls, p: torch.nn.Parameter, foreach: bool | None) -> torch.optim.Optimizer:
    group = {"params": [p], "use_muon": True}
    if cls is MuSGD:
        return cls([group], lr=0.05, momentum=0.9, foreach=foreach)
    return cls([group], lr=0.05, foreach=foreach)
