"""The public path of the Ultralytics integration (:mod:`fastmuon.integrations.ultralytics`):
``import fastmuon.ultralytics; fastmuon.ultralytics.install()`` before training."""

from .integrations.ultralytics import (
    ULTRALYTICS_NONFINITE,
    install,
    installed,
    musgd_for_ultralytics,
    uninstall,
)

__all__ = ["ULTRALYTICS_NONFINITE", "install", "installed", "musgd_for_ultralytics", "uninstall"]
