"""A tiny on-disk detection dataset and an offline Ultralytics for the trainer tests."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import numpy as np
from integration_support import TESTED_WITH_TORCHVISION, torchvision_problem

IMAGE_SIZE = 64


def offline_environment(root: Path) -> dict[str, str]:
    """Variables that keep Ultralytics' settings, fonts and downloads inside ``root`` and offline.

    They must be set before ``ultralytics`` is first imported (it reads them at import)."""
    return {
        "YOLO_CONFIG_DIR": str(root / "config"),
        "YOLO_OFFLINE": "1",
        "YOLO_VERBOSE": "False",
        "WANDB_MODE": "disabled",
    }


def import_unavailable_reason() -> str | None:
    """Why Ultralytics' trainer cannot run here, or None when it can. Ultralytics reads
    torchvision's version when it is imported and runs torchvision's NMS in validation: it is
    asked first, in a fresh interpreter (see :func:`integration_support.torchvision_problem`)."""
    if importlib.util.find_spec("ultralytics") is None:
        return "ultralytics is not installed; pip install -e '.[ultralytics]'"
    problem = torchvision_problem()
    if problem is not None:
        return f"it needs an importable torchvision: {problem}; {TESTED_WITH_TORCHVISION}"
    for module in ("ultralytics", "cv2", "yaml", "polars"):
        try:
            importlib.import_module(module)
        except Exception as e:  # any failure to load means the trainer cannot run
            return f"{module} does not import ({type(e).__name__}: {e}); pip install -e '.[ultralytics]'"
    return None


def make_detection_dataset(root: Path, images: int = 6, seed: int = 0) -> Path:
    """``images`` 64x64 pictures, each with one or two filled rectangles labelled in YOLO format
    (class cx cy w h, normalised); returns the data yaml (train and val are the same images)."""
    import cv2

    rng = np.random.default_rng(seed)
    image_dir, label_dir = root / "images" / "train", root / "labels" / "train"
    image_dir.mkdir(parents=True)
    label_dir.mkdir(parents=True)
    for i in range(images):
        picture = rng.integers(0, 60, size=(IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
        lines = []
        for _ in range(1 + i % 2):
            w, h = rng.integers(12, 32, size=2)
            x0, y0 = rng.integers(0, IMAGE_SIZE - w), rng.integers(0, IMAGE_SIZE - h)
            cls = int(rng.integers(0, 2))
            colour = (200, 40, 40) if cls == 0 else (40, 200, 40)
            picture[y0 : y0 + h, x0 : x0 + w] = colour
            cx, cy = (x0 + w / 2) / IMAGE_SIZE, (y0 + h / 2) / IMAGE_SIZE
            lines.append(f"{cls} {cx:.6f} {cy:.6f} {w / IMAGE_SIZE:.6f} {h / IMAGE_SIZE:.6f}")
        cv2.imwrite(str(image_dir / f"{i}.png"), picture)
        (label_dir / f"{i}.txt").write_text("\n".join(lines) + "\n")
    data = root / "data.yaml"
    data.write_text(f"path: {root}\ntrain: images/train\nval: images/train\nnames:\n  0: red\n  1: green\n")
    return data


def train_arguments(data: Path, project: Path, name: str, **overrides) -> dict:
    """Arguments for a deterministic, quiet, offline CPU run that takes seconds."""
    defaults = dict(
        data=str(data),
        imgsz=IMAGE_SIZE,
        batch=2,
        nbs=2,  # accumulate=1: one optimizer step per batch
        epochs=1,
        workers=0,
        device="cpu",
        deterministic=True,
        seed=0,
        plots=False,
        val=False,
        amp=False,
        project=str(project),
        name=name,
        exist_ok=True,
        verbose=False,
        mosaic=0.0,
    )
    return {**defaults, **overrides}


class RecordOptimizerAndStop:
    """A trainer callback for ``on_pretrain_routine_end`` (the optimizer exists by then): writes the
    optimizer's class and NS dtype to ``path`` and ends the run. A module-level class, so that a
    pickled trainer (Ultralytics' DDP state file) refers to it by name."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, trainer) -> None:
        optimizer = trainer.optimizer
        kind = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        Path(self.path).write_text(f"{kind} {optimizer.defaults.get('ns_dtype')}")
        raise SystemExit(0)
