"""Exact resume: N steps in one go equal k steps, save, load (even in a fresh process), N−k steps."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import resume_job
import torch
from torch import nn

import fastmuon

N, K = 6, 3


def _states(model, opt):
    return list(model.state_dict().values()) + [
        v for s in opt.state_dict()["state"].values() for v in s.values() if isinstance(v, torch.Tensor)
    ]


def _assert_bitwise(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y), (x - y).abs().max()


def _uninterrupted(kind, channels_last=False):
    model, opt, sched = resume_job.build(kind, channels_last)
    resume_job.train(model, opt, sched, 0, N)
    return model, opt, sched


def _map_state_tensors(ckpt: dict, fn) -> None:
    """Replace every tensor in the checkpoint's optimizer state by ``fn(tensor)``."""
    for state in ckpt["opt"]["state"].values():
        for key, v in state.items():
            if isinstance(v, torch.Tensor):
                state[key] = fn(v)


def _checkpoint_after_k(kind, channels_last=False) -> io.BytesIO:
    model, opt, sched = resume_job.build(kind, channels_last)
    resume_job.train(model, opt, sched, 0, K)
    buf = io.BytesIO()
    resume_job.save(buf, model, opt, sched, K, kind=kind, channels_last=channels_last)
    buf.seek(0)
    return buf


@pytest.mark.parametrize("kind", resume_job.KINDS)
@pytest.mark.parametrize("channels_last", [False, True])
def test_resume_in_process_is_bitwise(kind, channels_last):
    model, opt, sched = _uninterrupted(kind, channels_last)
    model2, opt2, sched2, start = resume_job.load(
        _checkpoint_after_k(kind, channels_last), kind, channels_last
    )
    resume_job.train(model2, opt2, sched2, start, N)
    _assert_bitwise(_states(model, opt), _states(model2, opt2))
    assert sched.get_last_lr() == sched2.get_last_lr()
    assert opt.param_groups[0]["lr"] == opt2.param_groups[0]["lr"]


@pytest.mark.slow
def test_resume_in_a_fresh_process_is_bitwise(tmp_path: Path):
    """The second half runs in a new interpreter: nothing but the checkpoint carries over."""
    src = str(Path(fastmuon.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    jobs = []
    for kind in resume_job.KINDS:
        ckpt, out = tmp_path / f"{kind}.pt", tmp_path / f"{kind}-final.pt"
        ckpt.write_bytes(_checkpoint_after_k(kind).getvalue())
        jobs.append((kind, out, [sys.executable, resume_job.__file__, str(ckpt), str(N - K), str(out)]))
    # Same thread count as this process (CPU matmul blocking depends on it; other tests change it).
    script = f"import torch; torch.set_num_threads({torch.get_num_threads()}); " + "; ".join(
        f"import runpy, sys; sys.argv = {cmd[1:]!r}; runpy.run_path({cmd[1]!r}, run_name='__main__')"
        for *_, cmd in jobs
    )
    # warnings are errors in the child too (pytest's filters do not reach it)
    subprocess.run([sys.executable, "-W", "error", "-c", script], env=env, check=True, timeout=120)
    for kind, out, _ in jobs:
        model, opt, sched = _uninterrupted(kind)
        model2, opt2, sched2, step = resume_job.load(out, kind)
        assert step == N
        _assert_bitwise(_states(model, opt), _states(model2, opt2))
        assert sched.state_dict() == sched2.state_dict()


@pytest.mark.parametrize("kind", resume_job.KINDS)
def test_fp16_compressed_state_is_cast_back(kind):
    """Buffers saved in fp16 load as the parameters' dtype; the run continues close to exact."""
    ckpt = torch.load(_checkpoint_after_k(kind), weights_only=True)
    _map_state_tensors(ckpt, torch.Tensor.half)  # the step count too: it must come back as fp32 on the CPU
    model, opt, sched = resume_job.build(kind)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    sched.load_state_dict(ckpt["sched"])
    for p, s in opt.state.items():
        for key, v in s.items():
            if key == "step":
                assert v.dtype == torch.float32 and v.device.type == "cpu"
            else:
                assert v.dtype == p.dtype and v.shape == p.shape
    resume_job.train(model, opt, sched, K, N)
    ref, _, _ = _uninterrupted(kind)
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)  # fp16 rounding of the momenta


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", resume_job.KINDS)
def test_state_saved_on_another_device_loads_bitwise(kind):
    ckpt = torch.load(_checkpoint_after_k(kind), weights_only=True)
    _map_state_tensors(ckpt, torch.Tensor.cuda)
    model, opt, sched = resume_job.build(kind)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    sched.load_state_dict(ckpt["sched"])
    for s in opt.state.values():
        assert all(v.device.type == "cpu" for v in s.values())
    resume_job.train(model, opt, sched, K, N)
    ref, ref_opt, _ = _uninterrupted(kind)
    _assert_bitwise(_states(ref, ref_opt), _states(model, opt))


def _with_muon(opt_cls) -> dict:
    """MuSGD's matrices in Muon (its default, as Ultralytics', is SGD for a plain list)."""
    return {"use_muon": True} if opt_cls is fastmuon.MuSGD else {}


def _stepped(opt_cls, params, **kw):
    opt = opt_cls(params, **_with_muon(opt_cls), **kw)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


@pytest.mark.parametrize("opt_cls", [fastmuon.MuSGD, fastmuon.Muon])
def test_state_from_another_layout_is_refused(opt_cls):
    a = [nn.Parameter(torch.zeros(4, 3)), nn.Parameter(torch.zeros(5, 2, 3, 3)), nn.Parameter(torch.zeros(3))]
    saved = _stepped(opt_cls, a, momentum=0.9, ns_dtype=torch.float32).state_dict()

    swapped = [
        nn.Parameter(torch.zeros(5, 2, 3, 3)),
        nn.Parameter(torch.zeros(4, 3)),
        nn.Parameter(torch.zeros(3)),
    ]
    opt = _stepped(opt_cls, swapped, momentum=0.9, ns_dtype=torch.float32)
    before = {k: v.clone() for k, v in opt.state[swapped[0]].items()}
    with pytest.raises(
        ValueError, match=r"parameter 0 of param group 0 \(shape \(5, 2, 3, 3\)\).*different parameter layout"
    ):
        opt.load_state_dict(saved)
    for k, v in opt.state[swapped[0]].items():  # a refused load changes nothing
        assert torch.equal(v, before[k])

    fewer = opt_cls([nn.Parameter(torch.zeros(4, 3))], momentum=0.9, **_with_muon(opt_cls))
    with pytest.raises(ValueError, match="has 3 parameters in the state dict and 1 in this optimizer"):
        fewer.load_state_dict(saved)

    two_groups = opt_cls([{"params": [a[0]]}, {"params": a[1:]}], momentum=0.9, **_with_muon(opt_cls))
    with pytest.raises(ValueError, match="1 param groups, this optimizer 2"):
        two_groups.load_state_dict(saved)


def test_named_parameters_appear_in_layout_errors():
    model = nn.Linear(3, 4)
    saved = _stepped(fastmuon.MuSGD, list(model.parameters()), momentum=0.9).state_dict()
    other = nn.Linear(4, 3)
    opt = fastmuon.MuSGD(list(other.named_parameters()), momentum=0.9, use_muon=True)
    with pytest.raises(
        ValueError, match=r"parameter 'weight' \(shape \(3, 4\)\): saved state 'momentum_buffer'"
    ):
        opt.load_state_dict(saved)
