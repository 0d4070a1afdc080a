"""The public path of the attention logit recorder for QK-clip
(:mod:`fastmuon.integrations.logit_max`): ``LogitMaxRecorder(model).attach(opt)``."""

from .integrations.logit_max import LogitMaxRecorder, head_maxima

__all__ = ["LogitMaxRecorder", "head_maxima"]
