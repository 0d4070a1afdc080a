"""QK-clip (MuonClip, Kimi K2) in Muon, NorMuon and AdaMuon, on plain tensors: the clip after the
update against the per-head reference written from the published rule (GQA and MLA layouts), its
options refused where they are wrong, a step without maxima, state-dict round trips, and the
per-head maxima of attention logits against all heads' logits at once."""

from __future__ import annotations

import copy
import inspect
import io
import pickle
import warnings

import pytest
import torch
from conftest import rel_err
from reference_impl import logit_maxima_reference, mla_qk_clip_reference, qk_clip_reference
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fastmuon import AdaMuon, Muon, MuSGD, NorMuon
from fastmuon.bench.hosttime import host_syncs
from fastmuon.integrations.logit_max import head_maxima

H, K, D, IN = 4, 2, 3, 10  # query heads, key heads, head dim, model width
TAU = 1.0
MAXIMA = torch.tensor([0.5, 3.0, 1.2, 8.0])  # heads 1, 2 and 3 over τ; head 0 under
QUERY = {"layer": "attn", "part": "query", "heads": H}
KEY = {"layer": "attn", "part": "key", "heads": K}
NOPE, ROPE, V, RANK = 2, 3, 2, 6
MLA_Q = {"layer": "mla", "part": "mla_query", "heads": H, "nope_dim": NOPE, "rope_dim": ROPE}
MLA_KV = {"layer": "mla", "part": "mla_key_value", "heads": H, "nope_dim": NOPE, "v_dim": V}
F32 = {"ns_dtype": torch.float32}


def attention_params(seed: int = 0) -> list[nn.Parameter]:
    """A query, key and output projection, the query's bias, and MLA's two up-projections."""
    g = torch.Generator().manual_seed(seed)
    shapes = [
        (H * D, IN),
        (K * D, IN),
        (IN, H * D),
        (H * D,),
        (H * (NOPE + ROPE), RANK),
        (H * (NOPE + V), RANK),
    ]
    return [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def groups_of(params, parts: bool = True, **clip):
    q, k, o, bias, mla_q, mla_kv = params
    matrices = {"params": [q, k, o, mla_q, mla_kv], "use_muon": True, **clip}
    others = {"params": [bias], "use_muon": False, **clip}
    if parts:
        matrices["attention"] = [QUERY, KEY, None, MLA_Q, MLA_KV]
        others["attention"] = [QUERY]
    return [matrices, others]


def set_grads(params, seed: int) -> None:
    g = torch.Generator().manual_seed(100 + seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def clone(params):
    return [nn.Parameter(p.detach().clone()) for p in params]


@pytest.mark.parametrize("alpha", [0.5, 0.3])
@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("cls", [Muon, NorMuon, AdaMuon])
def test_the_clip_scales_each_heads_rows_after_the_update_as_the_published_rule(cls, foreach, alpha):
    """The clipped run equals the unclipped run (the same optimizer without QK-clip) followed by
    the per-head reference: GQA queries by their own γ^α, each key head by its query group's
    smallest γ to the 1−α, a query bias like its rows, MLA's content rows by γ^α and γ^(1−α), its
    rotary query rows by γ, its values not at all; the other parameters as without the clip."""
    params = attention_params()
    plain = clone(params)
    clipped = cls(groups_of(params), lr=0.02, qk_clip_tau=TAU, qk_clip_alpha=alpha, foreach=foreach, **F32)
    unclipped = cls(groups_of(plain, parts=False), lr=0.02, foreach=foreach, **F32)
    mla_maxima = torch.tensor([2.0, 0.9, 5.0, 1.1])
    for step in range(3):
        set_grads(params, step)
        set_grads(plain, step)
        clipped.step(logit_maxima={"attn": MAXIMA * (step + 1), "mla": mla_maxima})
        unclipped.step()
        with torch.no_grad():
            heads = dict(heads=H, kv_heads=K, tau=TAU, alpha=alpha)
            q, k = qk_clip_reference(plain[0], plain[1], MAXIMA * (step + 1), **heads)
            bias, _ = qk_clip_reference(plain[3], plain[1], MAXIMA * (step + 1), **heads)
            mla = dict(heads=H, nope=NOPE, rope=ROPE, v=V, tau=TAU, alpha=alpha)
            mla_q, mla_kv = mla_qk_clip_reference(plain[4], plain[5], mla_maxima, **mla)
            for p, want in zip(plain, (q, k, plain[2], bias, mla_q, mla_kv)):
                p.copy_(want)
        for name, got, want in zip(("q", "k", "o", "bias", "mla_q", "mla_kv"), params, plain):
            assert rel_err(got.detach(), want.detach()) < 1e-6, (name, step)
    # the clip did act: the run differs from one without it
    assert not torch.allclose(params[0], unclipped_copy(cls, foreach)[0])


def unclipped_copy(cls, foreach):
    """The query weight after the same three steps with no clip at all."""
    params = attention_params()
    opt = cls(groups_of(params, parts=False), lr=0.02, foreach=foreach, **F32)
    for step in range(3):
        set_grads(params, step)
        opt.step()
    return params


@pytest.mark.parametrize("kv_heads", [1, H])
def test_multi_query_and_multi_head_layouts(kv_heads):
    """One key head for all queries (MQA) takes the smallest γ of all; one per query (MHA) its own."""
    q, k = nn.Parameter(torch.randn(H * D, IN)), nn.Parameter(torch.randn(kv_heads * D, IN))
    want_q, want_k = qk_clip_reference(q, k, MAXIMA, heads=H, kv_heads=kv_heads, tau=TAU, alpha=0.5)
    key = {**KEY, "heads": kv_heads}
    opt = Muon([{"params": [q, k], "attention": [QUERY, key]}], lr=0.0, weight_decay=0.0, qk_clip_tau=TAU)
    q.grad, k.grad = torch.zeros_like(q), torch.zeros_like(k)
    opt.step(logit_maxima={"attn": MAXIMA})  # lr 0: the update leaves them, the clip acts alone
    assert rel_err(q.detach(), want_q) < 1e-6 and rel_err(k.detach(), want_k) < 1e-6


def test_no_head_over_tau_changes_nothing_bitwise():
    params = attention_params()
    plain = clone(params)
    clipped = Muon(groups_of(params), lr=0.02, qk_clip_tau=100.0)
    unclipped = Muon(groups_of(plain, parts=False), lr=0.02)
    for step in range(2):
        set_grads(params, step)
        set_grads(plain, step)
        clipped.step(logit_maxima={"attn": MAXIMA, "mla": MAXIMA})
        unclipped.step()
    assert all(torch.equal(a, b) for a, b in zip(params, plain))


def test_a_capturable_clip_reads_nothing_on_the_host_and_clips_alike():
    """With ``capturable=True`` the clip decides nothing on the host (every part is scaled, by 1
    where no head is over τ), so a step with it can be captured; the weights are the same."""
    params = attention_params()
    twin = clone(params)
    opt = Muon(groups_of(params), lr=0.02, qk_clip_tau=TAU, capturable=True, nonfinite="skip")
    for group in opt.param_groups:
        group["lr"] = torch.tensor(group["lr"])
    plain = Muon(groups_of(twin), lr=0.02, qk_clip_tau=TAU, nonfinite="skip")
    run(opt, params, range(1))
    run(plain, twin, range(1))
    set_grads(params, 1)
    set_grads(twin, 1)
    maxima = {"attn": MAXIMA, "mla": torch.zeros(H)}  # one layer clipped, one not
    assert host_syncs(lambda: opt.step(logit_maxima=maxima)) == {}
    plain.step(logit_maxima=maxima)
    assert all(rel_err(a.detach(), b.detach()) < 1e-6 for a, b in zip(params, twin))


def test_a_step_without_maxima_clips_nothing_and_says_so_once():
    params = attention_params()
    plain = clone(params)
    clipped = Muon(groups_of(params), lr=0.02, qk_clip_tau=TAU)
    unclipped = Muon(groups_of(plain, parts=False), lr=0.02)
    set_grads(params, 0)
    set_grads(plain, 0)
    with pytest.warns(UserWarning, match="no attention logit maxima for this step") as caught:
        clipped.step()
    assert caught[0].filename == __file__  # at the caller's line
    assert "logit_maxima" in str(caught[0].message) and "LogitMaxRecorder" in str(caught[0].message)
    unclipped.step()
    set_grads(params, 1)
    set_grads(plain, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clipped.step(logit_maxima={})  # an empty record is no maxima too: once said, not again
        unclipped.step()
    assert all(torch.equal(a, b) for a, b in zip(params, plain))


def test_the_clip_off_or_in_musgd_takes_no_maxima_and_warns_nothing():
    """Groups without qk_clip_tau ignore maxima (a recorder may stay attached with the clip off)."""
    params = attention_params()
    opt = Muon(groups_of(params), lr=0.02)  # parts, but no qk_clip_tau
    set_grads(params, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step(logit_maxima={"attn": MAXIMA})
        opt.step()
    with pytest.raises(
        ValueError, match="^qk_clip_tau in param group 0: MuSGD does not take QK-clip; use Muon"
    ):
        MuSGD([{"params": params[:2], "use_muon": True, "qk_clip_tau": 1.0}])


# ----- refused settings ------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [Muon, NorMuon, AdaMuon])
@pytest.mark.parametrize(
    "settings, match",
    [
        ({"qk_clip_tau": 0.0}, r"invalid qk_clip_tau 0\.0 in param group 0: it must be a finite number > 0"),
        ({"qk_clip_tau": -5}, "invalid qk_clip_tau -5 in .*or None to turn QK-clip off"),
        ({"qk_clip_tau": float("inf")}, "invalid qk_clip_tau inf"),
        ({"qk_clip_tau": True}, "invalid qk_clip_tau True"),
        ({"qk_clip_tau": "100"}, "invalid qk_clip_tau '100'"),
        ({"qk_clip_tau": 1.0, "qk_clip_alpha": 1.5}, r"invalid qk_clip_alpha 1\.5 in .*in \[0, 1\]"),
        ({"qk_clip_tau": 1.0, "qk_clip_alpha": -0.1}, "invalid qk_clip_alpha -0.1 .*splits it evenly"),
        ({"qk_clip_tau": 1.0, "qk_clip_alpha": None}, "invalid qk_clip_alpha None"),
    ],
)
def test_bad_clip_settings_are_refused_naming_the_option(cls, settings, match):
    params = attention_params()
    with pytest.raises(ValueError, match=match):
        cls(groups_of(params), **settings)  # as constructor keywords
    with pytest.raises(ValueError, match=match):
        cls([{**groups_of(params)[0], **settings}])  # as group keys
    opt = cls(groups_of(params))
    before = copy.deepcopy(opt.param_groups)
    with pytest.raises(ValueError, match=match.replace("group 0", "group 2")):
        opt.add_param_group({**groups_of(attention_params(1))[0], **settings})
    assert len(opt.param_groups) == 2 and opt.param_groups[0].keys() == before[0].keys()


def test_clip_settings_on_a_group_without_attention_weights_are_refused():
    params = attention_params()
    plain = groups_of(params, parts=False)
    with pytest.raises(
        ValueError, match=r"^qk_clip_tau=1\.0 in param group 1: this group holds no attention"
    ):
        Muon([groups_of(params)[0], {**plain[1], "qk_clip_tau": 1.0}])
    with pytest.raises(
        ValueError, match="qk_clip_alpha=0.2 in param group 0: .*param_groups\\(model, attention=True\\)"
    ):
        Muon([{**plain[0], "qk_clip_alpha": 0.2}])
    # the constructor's setting must reach some group's parts
    with pytest.raises(ValueError, match=r"^NorMuon\(qk_clip_tau=1\.0\): no param group holds attention"):
        NorMuon(plain, qk_clip_tau=1.0)
    # it applies to the groups with parts; the others (no parts) simply hold it, inert
    opt = Muon([groups_of(params)[0], plain[1]], qk_clip_tau=1.0)
    assert opt.param_groups[1]["qk_clip_tau"] == 1.0 and "attention" not in opt.param_groups[1]
    # a group that turns the clip off explicitly needs no parts
    Muon([groups_of(params)[0], {**plain[1], "qk_clip_tau": None}], qk_clip_tau=1.0)
    # torch fills each group dict with the defaults: the same dicts build a second optimizer
    reused = [groups_of(params)[0], {"params": plain[1]["params"]}]
    Muon(reused, qk_clip_tau=1.0)
    assert reused[1]["qk_clip_tau"] == 1.0 and reused[1]["qk_clip_alpha"] == 0.5
    Muon(reused, qk_clip_tau=1.0)


@pytest.mark.parametrize(
    "entry, match",
    [
        ({"layer": "attn", "part": "queries", "heads": H}, "'part' must be one of"),
        ({"layer": "attn", "part": "query"}, r"missing \['heads'\]"),
        ({"layer": "attn", "part": "query", "heads": H, "rope_dim": 2}, r"unknown \['rope_dim'\]"),
        ({"layer": "attn", "part": "query", "heads": 5}, "do not split into 5 heads"),
        ({"layer": "attn", "part": "query", "heads": 0}, "must be positive integers"),
        ({"layer": "", "part": "query", "heads": H}, "'layer' must be the attention layer's name"),
        ({**MLA_Q, "rope_dim": 2}, r"its 12 rows are not 4 heads of nope_dim \+ rope_dim = 4 rows"),
        ("query", "an attention entry is a dict"),
    ],
)
def test_bad_attention_parts_are_refused_naming_the_parameter(entry, match):
    q = nn.Parameter(torch.randn(H * D, IN))
    with pytest.raises(ValueError, match=match) as refused:
        Muon([{"params": [q], "attention": [entry], "param_names": ["blocks.0.attn.wq.weight"]}])
    assert "param group 0" in str(refused.value)
    with pytest.raises(ValueError, match="one entry per parameter"):
        Muon([{"params": [q], "attention": [QUERY, KEY]}])


def state_of(opt):
    return copy.deepcopy(opt.state_dict()), [
        p.detach().clone() for g in opt.param_groups for p in g["params"]
    ]


@pytest.mark.parametrize(
    "maxima, error, match",
    [
        ([1.0, 2.0], TypeError, "logit_maxima must be a dict"),
        ({"mla": MAXIMA}, ValueError, "no entry for attention layer 'attn' .*LogitMaxRecorder"),
        (
            {"attn": MAXIMA[:3], "mla": MAXIMA},
            ValueError,
            r"logit_maxima\['attn'\] for parameter 0 .*3 per-head maxima for a part of 4 query heads",
        ),
        (
            {"attn": MAXIMA, "mla": torch.ones(2, 4)},
            ValueError,
            r"logit_maxima\['mla'\] must be a 1-D tensor",
        ),
        ({"attn": MAXIMA, "mla": "big"}, ValueError, "must be a 1-D tensor"),
    ],
)
def test_maxima_that_do_not_fit_are_refused_before_anything_changes(maxima, error, match):
    params = attention_params()
    opt = Muon(groups_of(params), lr=0.02, qk_clip_tau=TAU)
    set_grads(params, 0)
    opt.step(logit_maxima={"attn": MAXIMA, "mla": MAXIMA})
    saved, weights = state_of(opt)
    set_grads(params, 1)
    with pytest.raises(error, match=match):
        opt.step(logit_maxima=maxima)
    after, current = state_of(opt)
    assert all(torch.equal(a, b) for a, b in zip(weights, current))
    for pid, buffers in saved["state"].items():
        assert all(torch.equal(v, after["state"][pid][n]) for n, v in buffers.items())


def test_key_maxima_must_give_each_key_head_whole_query_heads():
    k = nn.Parameter(torch.randn(K * D, IN))
    opt = Muon([{"params": [k], "attention": [KEY], "param_names": ["k"]}], qk_clip_tau=TAU)
    k.grad = torch.randn_like(k)
    with pytest.raises(
        ValueError, match="'k' .*3 per-head maxima: not a whole number of query heads for each of its 2"
    ):
        opt.step(logit_maxima={"attn": torch.ones(3)})


# ----- checkpoints and copies ------------------------------------------------------------------
def run(opt, params, steps, maxima_scale=1.0):
    for step in steps:
        set_grads(params, step)
        opt.step(logit_maxima={"attn": MAXIMA * maxima_scale * (1 + step), "mla": MAXIMA})


@pytest.mark.parametrize("cls", [Muon, NorMuon, AdaMuon])
def test_a_state_dict_round_trip_gives_identical_next_steps(cls):
    params = attention_params()
    opt = cls(groups_of(params), lr=0.02, qk_clip_tau=TAU, qk_clip_alpha=0.4)
    run(opt, params, range(2))
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)  # parts are plain dicts: weights_only loads them
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    twin = clone(params)
    resumed = cls(groups_of(twin, parts=False), lr=0.02)  # clip settings and parts come from the file
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["attention"] == [QUERY, KEY, None, MLA_Q, MLA_KV]
    assert (resumed.param_groups[0]["qk_clip_tau"], resumed.param_groups[1]["qk_clip_alpha"]) == (TAU, 0.4)
    run(opt, params, range(2, 4))
    run(resumed, twin, range(2, 4))
    assert all(torch.equal(a, b) for a, b in zip(params, twin))


def test_copies_and_pickles_clip_as_the_original_does():
    params = attention_params()
    opt = Muon(groups_of(params), lr=0.02, qk_clip_tau=TAU)
    run(opt, params, range(1))
    twin = copy.deepcopy((opt, params))
    pickled = pickle.loads(pickle.dumps((opt, params)))
    for o, ps in ((opt, params), twin, pickled):
        run(o, ps, range(1, 3))
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(params, twin[1], pickled[1]))


def test_muon_lists_the_clip_options_and_a_muon_checkpoint_leaves_them_out_of_musgd():
    signature = inspect.signature(Muon).parameters
    assert (signature["qk_clip_tau"].default, signature["qk_clip_alpha"].default) == (None, 0.5)
    assert all(signature[n].kind is inspect.Parameter.KEYWORD_ONLY for n in ("qk_clip_tau", "qk_clip_alpha"))
    params = attention_params()
    opt = Muon(groups_of(params), lr=0.02, qk_clip_tau=TAU)
    run(opt, params, range(1))
    musgd = MuSGD(groups_of(clone(params), parts=False))
    musgd.load_state_dict(opt.state_dict())
    assert all("qk_clip_tau" not in g and "qk_clip_alpha" not in g for g in musgd.param_groups)


# ----- the per-head maxima of attention logits ------------------------------------------------------
B, LQ, LK, DIM = 2, 9, 9, 4


def qk(heads=H, key_heads=K):
    return torch.randn(B, heads, LQ, DIM), torch.randn(B, key_heads, LK, DIM)


def test_head_maxima_match_all_heads_logits_at_once():
    q, k = qk()
    causal = torch.ones(LQ, LK, dtype=torch.bool).tril().expand(B, LQ, LK)
    want = logit_maxima_reference(q, k, 0.5, causal)
    assert rel_err(head_maxima(q, k, None, 0.5, causal=True), want) < 1e-6
    unmasked = logit_maxima_reference(q, k, 0.5, torch.ones(B, LQ, LK, dtype=torch.bool))
    assert rel_err(head_maxima(q, k, None, 0.5, causal=False), unmasked) < 1e-6
    keep = torch.rand(B, LQ, LK) > 0.6
    keep[:, :, 0] = True  # every query keeps a key
    want = logit_maxima_reference(q, k, 0.5, keep)
    assert rel_err(head_maxima(q, k, keep[:, None], 0.5, causal=True), want) < 1e-6  # the mask wins
    additive = torch.zeros(B, 1, LQ, LK).masked_fill(~keep[:, None], torch.finfo(torch.float32).min)
    assert rel_err(head_maxima(q, k, additive, 0.5, causal=False), want) < 1e-6
    per_head = keep[:, None].expand(B, H, LQ, LK).clone()
    per_head[:, 1] = True  # a mask with its own entries per head
    want_1 = logit_maxima_reference(q[:, 1:2], k[:, :1], 0.5, torch.ones(B, LQ, LK, dtype=torch.bool))
    assert rel_err(head_maxima(q, k, per_head, 0.5, causal=False)[1:2], want_1) < 1e-6


class LargestOutput(TorchDispatchMode):
    """The largest number of elements any op's output holds."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_head_maxima_hold_one_heads_logits_at_a_time():
    q, k = qk(heads=8, key_heads=2)
    keep = torch.rand(B, 1, LQ, LK) > 0.3
    for mask in (None, keep):
        with LargestOutput() as seen:
            head_maxima(q, k, mask, 0.5, causal=True)
        assert seen.largest == B * LQ * LK  # one head's (batch, queries, keys) block, never all eight


def test_an_fsdp2_sharded_attention_weight_is_refused_naming_the_fix(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        q = nn.Parameter(distribute_tensor(torch.randn(H * D, IN), mesh, [Shard(0)]))
        with pytest.raises(
            ValueError, match="FSDP2-sharded \\(DTensor\\) parameter with an attention part.*DDP"
        ):
            Muon([{"params": [q], "attention": [QUERY]}], qk_clip_tau=TAU)
        Muon([{"params": [q]}])  # without a part it is Muon's as ever
    finally:
        dist.destroy_process_group()
