"""fastmuon.MuSGD inside Ultralytics' real trainer: groups, lockstep updates, resume both ways, NaN, DDP.

Everything runs offline on a generated 64x64 detection dataset with yolo26n built from its yaml.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
import torch
from ultralytics_support import (
    RecordOptimizerAndStop,
    import_unavailable_reason,
    make_detection_dataset,
    offline_environment,
    train_arguments,
)

import fastmuon
import fastmuon.integrations.ultralytics as integration
from fastmuon.bench.contenders import Unavailable, load_ultralytics_musgd


class Interrupted(Exception):
    """Raised from a callback to stop a run after its first checkpoint, as a killed job would."""


@pytest.fixture(scope="module")
def yolo(tmp_path_factory):
    """An offline Ultralytics (settings, runs and DDP files under a temporary directory) and a dataset."""
    root = tmp_path_factory.mktemp("ultralytics")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in offline_environment(root).items():
            mp.setenv(name, value)
        try:
            reason = import_unavailable_reason()
            if reason is not None:
                pytest.skip(f"Ultralytics' trainer cannot run here: {reason}")
            import ultralytics.utils

            if not str(ultralytics.utils.USER_CONFIG_DIR).startswith(str(root)):
                pytest.skip(
                    "ultralytics was imported before its settings could be pointed at a temporary dir"
                )
            yield {
                "root": root,
                "data": make_detection_dataset(root / "data"),
                "env": offline_environment(root),
            }
        finally:
            integration.uninstall()


@contextmanager
def fastmuon_installed(**options):
    integration.install(**options)
    try:
        yield
    finally:
        integration.uninstall()


def run_args(yolo, name, **overrides):
    return train_arguments(yolo["data"], yolo["root"] / "runs", name, **overrides)


def train(yolo, name, *, callbacks=(), model="yolo26n.yaml", **overrides):
    """One ``YOLO(model).train(...)``; an :class:`Interrupted` from a callback ends it quietly."""
    from ultralytics import YOLO

    net = YOLO(model)
    for event, fn in callbacks:
        net.add_callback(event, fn)
    with suppress(Interrupted):
        net.train(**overrides) if overrides.get("resume") else net.train(**run_args(yolo, name, **overrides))
    return yolo["root"] / "runs" / name / "weights" / "last.pt"


def interrupt_after_first_checkpoint(trainer):
    raise Interrupted


def test_trainer_builds_fastmuon_musgd_with_ultralytics_groups_and_hyperparameters(yolo):
    from ultralytics.models.yolo.detect import DetectionTrainer

    trainer = DetectionTrainer(overrides=run_args(yolo, "groups", model="yolo26n.yaml", optimizer="MuSGD"))
    model = trainer.get_model(cfg="yolo26n.yaml", verbose=False)
    hyper = dict(lr=0.01, momentum=0.9, decay=5e-4)
    theirs = trainer.build_optimizer(model, name="MuSGD", **hyper)
    with fastmuon_installed():
        ours = trainer.build_optimizer(model, name="MuSGD", **hyper)
        auto = trainer.build_optimizer(model, name="auto", iterations=1e6, **hyper)
        short = trainer.build_optimizer(model, name="auto", iterations=1e4, **hyper)
    assert type(ours) is fastmuon.MuSGD and type(auto) is fastmuon.MuSGD
    assert type(short).__name__ == "AdamW"  # "auto" picks MuSGD for long runs only (see the README)
    assert type(theirs).__module__.startswith("ultralytics")
    assert ours.nonfinite == "ignore"
    assert len(ours.param_groups) == len(theirs.param_groups) == len(auto.param_groups)
    for mine, their in zip(ours.param_groups, theirs.param_groups):
        assert [id(p) for p in mine["params"]] == [id(p) for p in their["params"]]
        for key in ("lr", "momentum", "nesterov", "weight_decay", "param_group"):
            assert mine[key] == their[key], key
        assert mine["use_muon"] is their.get("use_muon", False)
        assert (mine["muon"], mine["sgd"]) == (theirs.muon, theirs.sgd)
    assert any(g["use_muon"] for g in ours.param_groups) and not all(g["use_muon"] for g in ours.param_groups)


class Lockstep:
    """Ultralytics' MuSGD (bf16 NS as shipped, and NS in fp32) and fastmuon's at fp32, each on its
    own copy of the weights, fed the gradients the trainer hands its optimizer (fastmuon's, NS at
    the bf16 default) every step; records each step's relative L2 error of the whole model's update
    between pairs of them."""

    def __init__(self):
        self.errors: list[dict[str, float]] = []

    def __call__(self, trainer):  # on_pretrain_routine_end: the optimizer has just been built
        live = trainer.optimizer
        mixing = dict(muon=live.param_groups[0]["muon"], sgd=live.param_groups[0]["sgd"])
        ultralytics_bf16, ultralytics_fp32 = (
            load_ultralytics_musgd()[0],
            load_ultralytics_musgd(fp32_ns=True)[0],
        )
        makers = {
            "fastmuon_fp32": lambda g: integration.musgd_for_ultralytics(g, **mixing, ns_dtype=torch.float32),
            "ultralytics_fp32": lambda g: ultralytics_fp32(g, **mixing),
            "ultralytics_bf16": lambda g: ultralytics_bf16(g, **mixing),
        }
        self.live = live
        self.shadows = {name: make(self._copy_groups(live)) for name, make in makers.items()}
        live.register_step_pre_hook(self._before)
        live.register_step_post_hook(self._after)

    @staticmethod
    def _copy_groups(live):
        keys = ("lr", "momentum", "nesterov", "weight_decay", "use_muon")
        return [
            {
                "params": [torch.nn.Parameter(p.detach().clone()) for p in g["params"]],
                **{k: g[k] for k in keys},
            }
            for g in live.param_groups
        ]

    def _pairs(self, opt):
        return [(p, g) for g in opt.param_groups for p in g["params"]]

    def _before(self, optimizer, args, kwargs):
        live = self._pairs(self.live)
        self.start = {"fastmuon_bf16": [p.detach().clone() for p, _ in live]}
        for name, shadow in self.shadows.items():
            for group, live_group in zip(shadow.param_groups, self.live.param_groups):
                group["lr"], group["momentum"] = live_group["lr"], live_group["momentum"]  # warm-up, schedule
            for (p, _), (q, _) in zip(self._pairs(shadow), live):
                p.grad = None if q.grad is None else q.grad.detach().clone()
            self.start[name] = [p.detach().clone() for p, _ in self._pairs(shadow)]

    def _after(self, optimizer, args, kwargs):
        updates = {
            "fastmuon_bf16": [
                p.detach() - s for (p, _), s in zip(self._pairs(self.live), self.start["fastmuon_bf16"])
            ]
        }
        for name, shadow in self.shadows.items():
            shadow.step()
            updates[name] = [p.detach() - s for (p, _), s in zip(self._pairs(shadow), self.start[name])]

        def err(a, b):  # relative L2 error of the whole model's update
            ours, theirs = (torch.cat([u.flatten().double() for u in updates[k]]) for k in (a, b))
            return ((ours - theirs).norm() / theirs.norm()).item()

        self.errors.append(
            {
                "fp32": err("fastmuon_fp32", "ultralytics_fp32"),
                "bf16": err("fastmuon_bf16", "ultralytics_bf16"),
                "ultralytics_bf16_vs_fp32": err("ultralytics_bf16", "ultralytics_fp32"),
                "fastmuon_bf16_vs_ultralytics_fp32": err("fastmuon_bf16", "ultralytics_fp32"),
            }
        )


@pytest.fixture(scope="module")
def fastmuon_run(yolo):
    """A two-epoch MuSGD run under fastmuon, stopped after its first epoch's checkpoint, with the
    Ultralytics optimizers in lockstep."""
    lockstep = Lockstep()
    with fastmuon_installed():
        last = train(
            yolo,
            "fastmuon",
            optimizer="MuSGD",
            epochs=2,
            callbacks=[
                ("on_pretrain_routine_end", lockstep),
                ("on_model_save", interrupt_after_first_checkpoint),
            ],
        )
    return {"last": last, "lockstep": lockstep}


@pytest.mark.slow
def test_lockstep_updates_match_ultralytics_musgd(fastmuon_run):
    errors = fastmuon_run["lockstep"].errors
    print("lockstep update errors per step:", errors)
    assert len(errors) >= 3
    for step in errors:
        assert step["fp32"] <= 1e-4, step
        assert step["bf16"] <= step["ultralytics_bf16_vs_fp32"], step


def checkpoint_state_matches(optimizer, checkpoint: Path) -> None:
    """The optimizer's momentum buffers are the checkpoint's (saved in fp16), parameter by parameter."""
    from ultralytics.utils.patches import torch_load

    saved = torch_load(checkpoint, map_location="cpu")["optimizer"]["state"]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    assert saved, "the checkpoint holds no optimizer state"
    for index, state in saved.items():
        for key, value in state.items():
            if key.startswith("momentum_buffer"):
                loaded = optimizer.state[params[index]][key]
                assert loaded.dtype == params[index].dtype
                torch.testing.assert_close(loaded.half(), value.half(), rtol=0, atol=0)


def resume(yolo, last, *, with_fastmuon: bool):
    seen = {}

    def record(trainer):  # on_train_start: after resume_training() loaded the checkpoint
        seen["optimizer"] = trainer.optimizer
        checkpoint_state_matches(trainer.optimizer, last)

    def trained_an_epoch(trainer):  # its steps are done; the final validation is not needed here
        seen["epoch"] = trainer.epoch
        seen["finite"] = all(p.isfinite().all() for p in trainer.model.parameters())
        raise Interrupted

    callbacks = [("on_train_start", record), ("on_train_epoch_end", trained_an_epoch)]
    if with_fastmuon:
        with fastmuon_installed():
            train(yolo, "", model=str(last), resume=True, callbacks=callbacks)
    else:
        train(yolo, "", model=str(last), resume=True, callbacks=callbacks)
    return seen


@pytest.mark.slow
def test_ultralytics_checkpoint_resumes_under_fastmuon(yolo):
    last = train(
        yolo,
        "ultralytics",
        optimizer="MuSGD",
        epochs=2,
        callbacks=[("on_model_save", interrupt_after_first_checkpoint)],
    )
    seen = resume(yolo, last, with_fastmuon=True)
    assert type(seen["optimizer"]) is fastmuon.MuSGD
    assert seen["epoch"] == 1 and seen["finite"]


@pytest.mark.slow
def test_fastmuon_checkpoint_resumes_under_ultralytics(yolo, fastmuon_run):
    seen = resume(yolo, fastmuon_run["last"], with_fastmuon=False)
    assert type(seen["optimizer"]).__module__.startswith("ultralytics")
    assert seen["epoch"] == 1 and seen["finite"]


@pytest.mark.slow
def test_nan_gradient_keeps_ultralytics_recovery_from_last_pt(yolo):
    """A NaN gradient mid-run: fastmuon steps through it as Ultralytics' MuSGD does, the loss goes
    NaN, and Ultralytics' trainer reloads last.pt and redoes the epoch instead of aborting."""
    epochs_started: list[int] = []
    poisoned = []

    def poison_first_step_of_second_epoch(trainer):
        def hook(optimizer, args, kwargs):
            if trainer.epoch == 1 and not poisoned:
                p = next(p for g in optimizer.param_groups if g["use_muon"] for p in g["params"])
                p.grad = torch.full_like(p.grad, math.nan)
                poisoned.append(p)

        trainer.optimizer.register_step_pre_hook(hook)

    def after_the_redone_epoch(trainer):
        if epochs_started == [0, 1, 1]:
            assert all(p.isfinite().all() for p in trainer.model.parameters())
            assert type(trainer.optimizer) is fastmuon.MuSGD
            raise Interrupted  # the recovery is shown; the rest of the run is not needed

    callbacks = [
        ("on_pretrain_routine_end", poison_first_step_of_second_epoch),
        ("on_train_epoch_start", lambda trainer: epochs_started.append(trainer.epoch)),
        ("on_train_epoch_end", after_the_redone_epoch),
    ]
    with fastmuon_installed():
        train(yolo, "nan", optimizer="MuSGD", epochs=3, callbacks=callbacks)
    assert poisoned, "no NaN was injected"
    assert epochs_started == [0, 1, 1], "Ultralytics did not redo the poisoned epoch from last.pt"


@pytest.mark.slow
def test_ddp_workers_build_fastmuon_musgd(yolo, tmp_path):
    """The trainer state Ultralytics pickles for its DDP workers carries the integration: a fresh
    interpreter running the generated worker file builds fastmuon.MuSGD with install()'s options."""
    import ultralytics.utils.dist as dist
    from ultralytics.models.yolo.detect import DetectionTrainer

    record = tmp_path / "optimizer.txt"
    trainer = DetectionTrainer(overrides=run_args(yolo, "ddp", model="yolo26n.yaml", optimizer="MuSGD"))
    trainer.add_callback("on_pretrain_routine_end", RecordOptimizerAndStop(str(record)))
    with fastmuon_installed(ns_dtype=torch.float32):
        command, worker_file = dist.generate_ddp_command(trainer)  # what BaseTrainer.train() runs
    assert command[-1] == worker_file
    try:
        env = {**yolo["env"], "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
        # the worker file as Ultralytics' launcher runs it: as __main__, in a fresh interpreter
        # (which unpickles the recording callback from this folder's ultralytics_support)
        here = Path(__file__).resolve().parent
        env["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parent)])  # and the suite's helpers
        done = subprocess.run(
            [sys.executable, worker_file],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        dist.ddp_cleanup(trainer, worker_file)
    assert record.read_text() == "fastmuon.optim.musgd.MuSGD torch.float32"


def test_fastmuon_yolo_command_runs_ultralytics_cli_with_the_integration(yolo, monkeypatch):
    import ultralytics.cfg

    seen = {}

    def entrypoint():
        seen["argv"], seen["installed"] = list(ultralytics.cfg.ARGV), integration.installed()

    monkeypatch.setattr(ultralytics.cfg, "entrypoint", entrypoint)
    monkeypatch.setattr(sys, "argv", ["fastmuon", "yolo", "train", "model=yolo26n.yaml", "optimizer=MuSGD"])
    monkeypatch.setattr(ultralytics.cfg, "ARGV", sys.argv)  # the list Ultralytics saw at import is sys.argv
    try:
        from fastmuon.tools.cli import main

        assert main(sys.argv[1:]) == 0
    finally:
        integration.uninstall()
    assert seen == {"argv": ["yolo", "train", "model=yolo26n.yaml", "optimizer=MuSGD"], "installed": True}


def test_install_twice_then_uninstall_restores_ultralytics(yolo):
    import ultralytics.engine.trainer as trainer_module
    import ultralytics.utils.dist as dist

    originals = trainer_module.MuSGD, dist.generate_ddp_file
    integration.install()
    integration.install(ns_dtype=torch.float32)
    assert integration.installed() and trainer_module.MuSGD is not originals[0]
    installed = trainer_module.MuSGD([{"params": [torch.nn.Parameter(torch.zeros(2, 2))], "use_muon": True}])
    assert installed.defaults["ns_dtype"] == torch.float32
    assert dist.generate_ddp_file.original is originals[1]  # wrapped once, not twice
    integration.uninstall()
    assert (trainer_module.MuSGD, dist.generate_ddp_file) == originals and not integration.installed()
    with pytest.raises(ValueError, match="muon.*train"):
        integration.install(muon=0.3)  # the trainer passes its own
    with pytest.raises(ValueError, match="ns_dtype"):
        integration.install(ns_dtype="half")
    with pytest.raises(TypeError, match="ns_stepz"):
        integration.install(ns_stepz=3)
    assert (trainer_module.MuSGD, dist.generate_ddp_file) == originals and not integration.installed()


def test_musgd_for_ultralytics_takes_ultralytics_arguments_in_their_order():
    import inspect

    try:
        theirs = inspect.signature(load_ultralytics_musgd()[0]).parameters
    except Unavailable as e:
        pytest.skip(str(e))
    ours = inspect.signature(integration.musgd_for_ultralytics).parameters
    shared = list(theirs)
    assert list(ours)[: len(shared)] == shared
    assert all(ours[n].default == theirs[n].default for n in shared)
