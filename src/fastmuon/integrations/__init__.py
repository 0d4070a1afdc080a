"""fastmuon inside other projects' training code.

- :mod:`.ultralytics`: Ultralytics' trainer builds :class:`fastmuon.MuSGD` (public path
  :mod:`fastmuon.ultralytics`);
- :mod:`.transformers`: optimizer factories for 🤗 Transformers' ``Trainer``, which must build the
  optimizer from the prepared model (public path :mod:`fastmuon.transformers`);
- :mod:`.logit_max`: per-head attention logit maxima from Transformers models, for QK-clip
  (public path :mod:`fastmuon.qk_clip`).

Each imports its project only when used, so ``import fastmuon`` needs none of them.
"""
