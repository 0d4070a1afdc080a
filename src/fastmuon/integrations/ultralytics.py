"""Run Ultralytics' trainer with :class:`fastmuon.MuSGD` wherever it would build its own MuSGD.

One line before training::

    import fastmuon.ultralytics
    fastmuon.ultralytics.install()
    YOLO("yolo26n.yaml").train(data="coco8.yaml", optimizer="MuSGD")

or, from a shell, ``fastmuon yolo train model=yolo26n.yaml data=coco8.yaml optimizer=MuSGD``.

How it reaches the optimizer: Ultralytics' ``BaseTrainer.build_optimizer`` makes the same
param groups and hyperparameters whatever the class, then calls the name ``MuSGD`` in
``ultralytics.engine.trainer`` (for ``optimizer="MuSGD"``, and for ``"auto"`` when it picks
MuSGD: in 8.4.190 for more than 10,000 iterations). :func:`install` rebinds that one name to :func:`musgd_for_ultralytics`, which takes
Ultralytics' arguments and returns a ``fastmuon.MuSGD``.

How it reaches DDP workers: multi-GPU Ultralytics pickles the trainer's class, arguments, model
and callbacks into a file and starts fresh ``torch.distributed.run`` workers that unpickle it,
so nothing patched in the launching process exists there. :func:`install` also wraps
``ultralytics.utils.dist.generate_ddp_file`` to add one callback to the trainer before it is
pickled; unpickling that callback in a worker calls :func:`install` there (with the same
options), before the worker builds its trainer. Nothing is written outside Ultralytics' own file.

NaN behaviour: Ultralytics recovers from a non-finite loss by reloading ``last.pt`` at the end
of the epoch, which needs the optimizer to carry on through the bad step rather than raise, so
the optimizer is built with ``nonfinite="ignore"`` unless :func:`install` is told otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from collections.abc import Iterable
from typing import Any

import torch

from .. import __version__
from ..optim.musgd import MuSGD

#: fastmuon's choice for a NaN/Inf gradient under Ultralytics: carry on, as Ultralytics' MuSGD does,
#: so its own end-of-epoch check sees the non-finite loss and reloads last.pt.
ULTRALYTICS_NONFINITE = "ignore"

#: the trainer event the DDP callback is filed under; any event works, it does nothing when run.
_DDP_EVENT = "on_pretrain_routine_start"

#: the arguments the trainer passes itself (through the groups or as keywords)
_TRAINER_ARGUMENTS = ("lr", "momentum", "weight_decay", "nesterov", "use_muon", "muon", "sgd")

#: (module, attribute) -> the object install() replaced; empty when not installed.
_replaced: dict[tuple[Any, str], Any] = {}


def musgd_for_ultralytics(
    params: Iterable[Any],
    lr: float = 1e-3,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    use_muon: bool = False,
    muon: float = 0.5,
    sgd: float = 0.5,
    **options: Any,
) -> MuSGD:
    """A ``fastmuon.MuSGD`` from the arguments Ultralytics' MuSGD takes, in its order and defaults
    (a group without ``use_muon`` takes the argument: SGD by default, as in Ultralytics).

    ``options`` are fastmuon's own keywords (``ns_dtype``, ``ns_method``, ``compile``, ...);
    ``nonfinite`` defaults to :data:`ULTRALYTICS_NONFINITE`.
    """
    options.setdefault("nonfinite", ULTRALYTICS_NONFINITE)
    return MuSGD(
        params,
        lr=lr,
        momentum=momentum,
        weight_decay=weight_decay,
        nesterov=nesterov,
        use_muon=use_muon,
        muon=muon,
        sgd=sgd,
        **options,
    )


def install(**options: Any) -> None:
    """Make Ultralytics' trainers build ``fastmuon.MuSGD`` for MuSGD, here and in DDP workers.

    ``options`` go to every ``fastmuon.MuSGD`` built (e.g. ``ns_dtype=torch.float32``). Calling
    it again replaces the options; :func:`uninstall` restores Ultralytics' own classes.
    """
    trainer_set = sorted(set(options) & set(_TRAINER_ARGUMENTS))
    if trainer_set:
        raise ValueError(
            f"install() got {', '.join(trainer_set)}, which Ultralytics' trainer sets itself; pass them "
            "to YOLO(...).train() (lr0=, momentum=, weight_decay=) instead"
        )
    musgd_for_ultralytics(
        [torch.nn.Parameter(torch.zeros(2, 2))], use_muon=True, **options
    )  # bad options fail here
    trainer_module, dist_module = _ultralytics_modules()
    original_generate = _replaced.get((dist_module, "generate_ddp_file"), dist_module.generate_ddp_file)
    _replace(trainer_module, "MuSGD", _Factory(options))
    _replace(dist_module, "generate_ddp_file", _DDPFileWithFastmuon(original_generate, options))


def uninstall() -> None:
    """Put back what :func:`install` replaced (a no-op when it is not installed)."""
    for (module, name), original in _replaced.items():
        setattr(module, name, original)
    _replaced.clear()


def installed() -> bool:
    """Whether Ultralytics' trainers currently build ``fastmuon.MuSGD``."""
    return bool(_replaced)


def _import_problem(e: BaseException) -> str:
    """What stops ``import ultralytics`` here, named (torchvision is the usual piece), and the fix."""
    if not _findable("ultralytics"):
        return 'fastmuon.ultralytics needs the ultralytics package; install it with pip install "fastmuon[ultralytics]"'
    text = f"{type(e).__name__}: {e}"
    if getattr(e, "name", None) == "torchvision" or "torchvision" in text:
        state = (
            f"does not import beside torch {torch.__version__}"
            if _findable("torchvision")
            else "is not installed"
        )
        return (
            f"Ultralytics needs torchvision, which {state} ({text}); install the torchvision paired "
            "with your torch, from the index torch came from (PyPI's x86-64 torchvision is built "
            "against its CUDA torch and does not import beside a CPU build)"
        )
    return f'Ultralytics does not import here ({text}); install it with pip install "fastmuon[ultralytics]"'


def _findable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a module entry without a spec
        return False


def _ultralytics_modules() -> tuple[Any, Any]:
    try:
        import ultralytics.engine.trainer as trainer_module
        import ultralytics.utils.dist as dist_module
    except (
        Exception
    ) as e:  # it imports torchvision, OpenCV, ...: any may fail to load, not only with ImportError
        raise ImportError(_import_problem(e)) from e
    if not hasattr(trainer_module, "MuSGD") or not hasattr(dist_module, "generate_ddp_file"):
        import ultralytics

        raise ImportError(
            f"ultralytics {ultralytics.__version__} has no MuSGD in its trainer (it arrived in 8.4); "
            'upgrade with pip install "fastmuon[ultralytics]"'
        )
    return trainer_module, dist_module


def _replace(module: Any, name: str, new: Any) -> None:
    _replaced.setdefault((module, name), getattr(module, name))
    setattr(module, name, new)


class _Factory:
    """What the trainer calls as ``MuSGD(params=groups, muon=..., sgd=...)``, with install()'s options."""

    def __init__(self, options: dict[str, Any]):
        self.options = options

    def __call__(self, params: Iterable[Any], *args: Any, **kwargs: Any) -> MuSGD:
        optimizer = musgd_for_ultralytics(params, *args, **{**self.options, **kwargs})
        logging.getLogger("ultralytics").info(
            f"fastmuon: MuSGD is fastmuon.MuSGD {__version__} "
            f"(ns_dtype={optimizer.defaults['ns_dtype']}, nonfinite={optimizer.nonfinite!r})"
        )
        return optimizer

    def __repr__(self) -> str:
        return f"fastmuon.ultralytics.musgd_for_ultralytics(**{self.options!r})"


class _DDPFileWithFastmuon:
    """``generate_ddp_file`` that first files a :class:`_InstallInWorker` among the trainer's callbacks."""

    def __init__(self, original: Any, options: dict[str, Any]):
        self.original = original
        self.options = options

    def __call__(self, trainer: Any) -> str:
        hooks = trainer.callbacks.setdefault(_DDP_EVENT, [])
        hooks[:] = [h for h in hooks if not isinstance(h, _InstallInWorker)]
        hooks.append(_InstallInWorker(self.options))
        return self.original(trainer)


class _InstallInWorker:
    """A trainer callback that does nothing when called; unpickling it runs :func:`install`.

    Ultralytics' DDP workers rebuild the trainer from a pickle of its callbacks, so this is
    unpickled in each worker before that worker builds its optimizer.
    """

    def __init__(self, options: dict[str, Any]):
        self.options = options

    def __call__(self, trainer: Any) -> None:
        return None

    def __reduce__(self):
        return (_install_in_worker, (self.options,))

    def __copy__(self) -> _InstallInWorker:  # copies stay in this process: no install() on the way
        return self

    def __deepcopy__(self, memo: dict) -> _InstallInWorker:
        return self


def _install_in_worker(options: dict[str, Any]) -> _InstallInWorker:
    install(**options)
    return _InstallInWorker(options)


# ----- ``fastmuon yolo ...``: Ultralytics' own command line with the integration installed
# (its options: fastmuon.integrations.yolo_options) -----
def run(args: argparse.Namespace) -> int:
    """Install the integration, then hand the arguments to Ultralytics' ``yolo`` entry point."""
    try:
        install()
    except ImportError as e:
        print(f"fastmuon yolo: error: {e}", file=sys.stderr)
        return 1  # a missing package, as the other subcommands exit for one
    from ultralytics.cfg import entrypoint

    # Ultralytics reads its arguments from sys.argv (the list object it saw at import): present
    # them as `yolo ARGS` in place so that list shows them too.
    sys.argv[:] = ["yolo", *args.yolo_args]
    entrypoint()
    return 0
