"""Per-head attention logit maxima from 🤗 Transformers models, for QK-clip.

QK-clip (``Muon(..., qk_clip_tau=...)``, see :mod:`fastmuon.optim.qk_clip`) needs, for every
attention layer and query head, the largest pre-softmax logit of the step's forward passes.
:class:`LogitMaxRecorder` collects them from a model whose attention runs through Transformers'
attention interface (Llama-family, DeepSeek-V3 and most decoders), eager or SDPA::

    recorder = LogitMaxRecorder(model)
    opt = fastmuon.Muon(fastmuon.param_groups(model, attention=True), lr=0.02, qk_clip_tau=100.0)
    recorder.attach(opt)  # each opt.step() takes the maxima recorded since the last one

or, by hand, ``opt.step(logit_maxima=recorder.take())``.

How: the recorder registers an attention implementation with Transformers
(``fastmuon_logit_max_sdpa`` or ``_eager``, mask functions those of the one it wraps), switches
the model to it, and hands itself to it at each forward as a keyword argument, the way
Transformers passes per-call arguments down to attention. That function takes, before running
the model's own eager or SDPA attention, each query head's maximum of ``QKᵀ·scaling`` (the scale
the model calls attention with, after RoPE) over the entries the mask keeps (causal where SDPA
would be), one head at a time: never more than one ``(batch, queries, keys)`` block of logits,
in float32. Only forwards in training mode count (an evaluation pass is not the step's).
:meth:`LogitMaxRecorder.close` restores the model's implementation.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

#: The implementations the recorder wraps, and the name each is registered under.
RECORDING = {"sdpa": "fastmuon_logit_max_sdpa", "eager": "fastmuon_logit_max_eager"}

#: The keyword argument the recorder reaches the attention function by.
RECORDER_KEYWORD = "fastmuon_logit_recorder"


def head_maxima(query: Tensor, key: Tensor, mask: Tensor | None, scaling: float, causal: bool) -> Tensor:
    """Each query head's largest ``query·keyᵀ·scaling`` over the entries the mask keeps,
    ``(heads,)`` in float32, one head's ``(batch, queries, keys)`` block at a time.

    ``query`` is ``(batch, heads, queries, dim)``, ``key`` ``(batch, key_heads, keys, dim)`` (a key
    head serves ``heads/key_heads`` query heads); ``mask`` is boolean (True: attend) or additive,
    broadcast to ``(batch, heads, queries, keys)``; without a mask, ``causal`` keeps query ``i``'s
    keys ``j <= i``."""
    heads, key_heads = query.shape[1], key.shape[1]
    group = heads // key_heads
    queries, keys = query.shape[2], key.shape[2]
    keep = None
    if mask is None and causal:
        keep = torch.ones(queries, keys, dtype=torch.bool, device=query.device).tril()
    out = torch.empty(heads, dtype=torch.float32, device=query.device)
    for h in range(heads):
        logits = torch.matmul(query[:, h].float(), key[:, h // group].float().transpose(-1, -2))
        logits.mul_(scaling)
        if mask is not None:
            m = mask[:, h if mask.shape[1] > 1 else 0] if mask.ndim == 4 else mask
            m = m[..., :keys]
            logits = logits.masked_fill(~m, -torch.inf) if m.dtype == torch.bool else logits.add_(m)
        elif keep is not None:
            logits.masked_fill_(~keep, -torch.inf)
        out[h] = logits.amax()
    return out


class LogitMaxRecorder:
    """Records each attention layer's per-head logit maxima of a Transformers model's training
    forwards (see the module docstring); :meth:`take` returns and clears them.

    ``model``: a Transformers model (a ``PreTrainedModel``) whose attention implementation is
    ``"eager"`` or ``"sdpa"``. Its maxima are keyed by each attention module's name in
    ``model.named_modules()``, the ``layer`` that ``fastmuon.param_groups(model, attention=True)``
    gives the parts of.
    """

    def __init__(self, model: nn.Module):
        config = getattr(model, "config", None)
        base = getattr(config, "_attn_implementation", None)
        switch = getattr(model, "set_attn_implementation", None)
        if not callable(switch) or base not in RECORDING:
            raise ValueError(
                f"LogitMaxRecorder records from Transformers models with eager or sdpa attention; this "
                f"{type(model).__name__} has attention implementation {base!r}: switch it with "
                "model.set_attn_implementation('sdpa') (or 'eager') first, or compute the maxima "
                "yourself and pass opt.step(logit_maxima={layer name: per-head maxima})"
            )
        _register(base)
        self.model = model
        self.base = base
        self._switch = switch
        self._names = {id(m): name for name, m in model.named_modules()}
        self._maxima: dict[str, Tensor] = {}
        switch(RECORDING[base])
        self._hook = model.register_forward_pre_hook(self._hand_in, with_kwargs=True)

    def _hand_in(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, RECORDER_KEYWORD: self}

    def record(
        self, module: nn.Module, query: Tensor, key: Tensor, mask: Tensor | None, kwargs: dict
    ) -> None:
        """Fold one attention call's per-head maxima into its layer's (training forwards only)."""
        name = self._names.get(id(module))
        if name is None or not module.training:
            return
        scaling = kwargs.get("scaling")
        if scaling is None:
            scaling = query.shape[-1] ** -0.5  # the attention functions' own default
        causal = False
        if self.base == "sdpa":  # SDPA is causal where no mask is given (eager then masks nothing)
            is_causal = kwargs.get("is_causal")
            causal = query.shape[2] > 1 and (
                is_causal if is_causal is not None else getattr(module, "is_causal", True)
            )
        with torch.no_grad():
            found = head_maxima(query.detach(), key.detach(), mask, float(scaling), bool(causal))
        held = self._maxima.get(name)
        self._maxima[name] = found if held is None else torch.maximum(held, found)

    def take(self) -> dict[str, Tensor] | None:
        """``{layer name: (heads,) maxima}`` of the training forwards since the last call (None
        if there was none), and a fresh start."""
        maxima, self._maxima = self._maxima, {}
        return maxima or None

    def attach(self, optimizer: torch.optim.Optimizer) -> RemovableHandle:
        """Hand the maxima to every ``optimizer.step()`` (a step pre-hook passing
        ``logit_maxima=self.take()``, unless the call gives its own); ``remove()`` the returned
        handle to stop. This is how a Trainer, which calls ``step()`` itself, gets them."""

        def hand_maxima(opt: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            maxima = self.take()
            if kwargs.get("logit_maxima") is not None:
                return args, kwargs
            return args, {**kwargs, "logit_maxima": maxima}

        return optimizer.register_step_pre_hook(hand_maxima)

    def close(self) -> None:
        """Stop recording: the model's attention implementation and forward are as they were."""
        self._hook.remove()
        if getattr(getattr(self.model, "config", None), "_attn_implementation", None) == RECORDING[self.base]:
            self._switch(self.base)

    def __enter__(self) -> LogitMaxRecorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _register(base: str) -> None:
    """Register the recording implementation that wraps ``base`` with Transformers (again is
    harmless: the same function under the same name)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(RECORDING[base], _recording(base))
    AttentionMaskInterface.register(RECORDING[base], ALL_MASK_ATTENTION_FUNCTIONS[base])


def _recording(base: str) -> Callable[..., Any]:
    def attention(
        module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, **kwargs
    ):
        recorder = kwargs.pop(RECORDER_KEYWORD, None)
        if recorder is not None:
            recorder.record(module, query, key, mask, kwargs)
        return _base_attention(base, module)(module, query, key, value, mask, **kwargs)

    attention.__qualname__ = attention.__name__ = RECORDING[base]
    return attention


def _base_attention(base: str, module: nn.Module) -> Callable[..., Any]:
    """The function ``base`` names for ``module``: Transformers' SDPA one, or the eager one of the
    module's own modeling file (each model defines its ``eager_attention_forward``)."""
    if base == "sdpa":
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise TypeError(
            f"{type(module).__name__}'s module defines no eager_attention_forward to record around; "
            "record with sdpa attention (model.set_attn_implementation('sdpa'))"
        )
    return eager


__all__ = ["LogitMaxRecorder", "head_maxima"]
