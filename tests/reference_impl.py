"""Plain per-parameter references written straight from the update formulas.

Deliberately independent of fastmuon's code: no batching, no foreach, fp32 maths, one
parameter at a time, so the batched optimizers are checked against the algorithm itself.
"""

from __future__ import annotations

import math

import torch

JORDAN = (3.4445, -4.7750, 2.0315)


def ns_reference(G: torch.Tensor, steps: int = 5, coefficients=JORDAN, eps: float = 1e-7) -> torch.Tensor:
    """Newton–Schulz on one matrix, fp32, transposing tall matrices."""
    X = G.to(torch.float32)
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (X.norm() + eps)
    schedule = [coefficients] if isinstance(coefficients[0], (int, float)) else list(coefficients)
    for k in range(steps):
        a, b, c = schedule[min(k, len(schedule) - 1)]
        A = X @ X.T
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X.T if tall else X


def adjust(mode: str, shape) -> float:
    rows, cols = shape[0], math.prod(shape[1:])
    return {
        "ultralytics": math.sqrt(max(1.0, shape[-2] / shape[-1])),
        "original": math.sqrt(max(1.0, rows / cols)),
        "match_rms_adamw": 0.2 * math.sqrt(max(rows, cols)),
        "spectral_unclamped": math.sqrt(rows / cols),
        "none": 1.0,
    }[mode]


def ema_update(p, g, state, beta, nesterov):
    """Muon's EMA momentum ``M ← β·M + (1−β)·g``; returns the update (Nesterov: ``β·M + (1−β)·g``)."""
    M = state.setdefault("momentum_buffer", torch.zeros_like(p))
    M.copy_(beta * M + (1 - beta) * g)
    return beta * M + (1 - beta) * g if nesterov else M


def sgd_step(p, g, state, key, lr, beta, nesterov, weight_decay):
    """SGD with heavy-ball momentum and coupled weight decay (the buffer under ``key``)."""
    g2 = g + weight_decay * p
    B = state.setdefault(key, torch.zeros_like(p))
    B.copy_(beta * B + g2)
    upd = g2 + beta * B if nesterov else B
    p.copy_(p - lr * upd)


def musgd_reference_step(
    p,
    g,
    state,
    *,
    lr,
    momentum,
    nesterov,
    weight_decay,
    muon,
    sgd,
    use_muon,
    adjust_lr="ultralytics",
    ns_steps=5,
    coefficients=JORDAN,
    eps=1e-7,
):
    """One MuSGD step on one parameter (in place on ``p`` and ``state``)."""
    beta = momentum
    muon_group = use_muon if use_muon is not None else p.ndim >= 2
    if muon_group and p.ndim >= 2:
        U = ema_update(p, g, state, beta, nesterov)
        O = ns_reference(U.reshape(U.shape[0], -1), ns_steps, coefficients, eps).reshape(p.shape)
        O = O.to(p.dtype) * adjust(adjust_lr, p.shape)
        p.copy_(p - lr * muon * O)
    key = "momentum_buffer_SGD" if muon_group else "momentum_buffer"
    sgd_step(p, g, state, key, lr * (sgd if muon_group else 1.0), beta, nesterov, weight_decay)


def muon_reference_step(
    p,
    g,
    state,
    *,
    lr,
    momentum,
    nesterov,
    weight_decay,
    adjust_lr_fn=None,
    ns_steps=5,
    coefficients=JORDAN,
    eps=1e-7,
):
    """One Muon step on one matrix parameter."""
    beta = momentum
    U = ema_update(p, g, state, beta, nesterov)
    O = ns_reference(U.reshape(U.shape[0], -1), ns_steps, coefficients, eps).reshape(p.shape)
    p.copy_(p * (1 - lr * weight_decay))
    p.copy_(p - lr * adjust(adjust_lr_fn or "original", p.shape) * O.to(p.dtype))


def adamw_reference_step(p, g, state, *, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
    b1, b2 = betas
    t = state["t"] = state.get("t", 0) + 1
    m = state.setdefault("m", torch.zeros_like(p))
    v = state.setdefault("v", torch.zeros_like(p))
    p.copy_(p * (1 - lr * weight_decay))
    m.copy_(b1 * m + (1 - b1) * g)
    v.copy_(b2 * v + (1 - b2) * g * g)
    mhat = m / (1 - b1**t)
    vhat = v / (1 - b2**t)
    p.copy_(p - lr * mhat / (vhat.sqrt() + eps))


def _piece_updates(U, pieces, ns_steps, coefficients, eps, factor_of):
    """The orthogonalised update of a tensor holding several matrices: ``pieces`` are
    ``(index, transposed)``; each matrix ``U[index]`` (transposed back to ``(out, in)`` where
    stored ``(in, out)``) is orthogonalised alone and scaled by ``factor_of(its shape)``."""
    update = torch.zeros_like(U)
    for box, transposed in pieces:
        u = U[box]
        u = u.T if transposed else u
        O = ns_reference(u.reshape(u.shape[0], -1), ns_steps, coefficients, eps).reshape(u.shape)
        O = O * factor_of(u.shape)
        update[box] = O.T if transposed else O
    return update


def muon_reference_pieces(
    p,
    g,
    state,
    pieces,
    *,
    lr,
    momentum,
    nesterov,
    weight_decay,
    adjust_lr_fn=None,
    ns_steps=5,
    coefficients=JORDAN,
    eps=1e-7,
):
    """One Muon step on a tensor holding several matrices (see :func:`_piece_updates`)."""
    beta = momentum
    U = ema_update(p, g, state, beta, nesterov)
    update = _piece_updates(
        U, pieces, ns_steps, coefficients, eps, lambda s: adjust(adjust_lr_fn or "original", s)
    )
    p.copy_(p * (1 - lr * weight_decay))
    p.copy_(p - lr * update.to(p.dtype))


def musgd_reference_pieces(
    p,
    g,
    state,
    pieces,
    *,
    lr,
    momentum,
    nesterov,
    weight_decay,
    muon,
    sgd,
    adjust_lr="ultralytics",
    ns_steps=5,
    coefficients=JORDAN,
    eps=1e-7,
):
    """One MuSGD step on a tensor holding several matrices: the Muon half per matrix, the SGD
    half on the whole tensor."""
    beta = momentum
    U = ema_update(p, g, state, beta, nesterov)
    update = _piece_updates(U, pieces, ns_steps, coefficients, eps, lambda s: adjust(adjust_lr, s))
    p.copy_(p - lr * muon * update.to(p.dtype))
    sgd_step(p, g, state, "momentum_buffer_SGD", lr * sgd, beta, nesterov, weight_decay)


# ----- the second-moment variants and cautious weight decay, from their papers -------------------
def normuon_normalize(O, v, *, beta2, eps, rescale):
    """NorMuon (arXiv 2510.05491, Algorithm 1) after NS on one ``m×n`` matrix ``O``: ``v ∈ ℝᵐ``
    (updated in place) the EMA of each row's mean square; the rescale keeps ``‖O‖_F`` ("norm", the
    authors' code) or gives RMS 0.2 ("rms", the paper's η̂)."""
    m, n = O.shape
    v.copy_(beta2 * v + (1 - beta2) * (O * O).sum(dim=1) / n)
    Ohat = O / (v.sqrt()[:, None] + eps)
    target = O.norm() if rescale == "norm" else 0.2 * math.sqrt(m * n)
    return Ohat * target / max(Ohat.norm(), eps)


def adamuon_normalize(O, v, *, beta2, eps, rescale="rms"):
    """AdaMuon (arXiv 2507.11005) after NS on one matrix: ``v`` (``O``'s shape, in place) the EMA
    of ``O⊙O``, no bias correction, then the RMS-aligned rescale ``0.2·√(mn)/‖Ô‖_F``."""
    m, n = O.shape
    v.copy_(beta2 * v + (1 - beta2) * O * O)
    Ohat = O / (v.sqrt() + eps)
    target = O.norm() if rescale == "norm" else 0.2 * math.sqrt(m * n)
    return Ohat * target / max(Ohat.norm(), eps)


def variant_reference_step(
    p,
    g,
    state,
    *,
    variant,
    lr,
    momentum,
    nesterov,
    weight_decay,
    beta2=0.95,
    moment_eps=1e-8,
    rescale=None,
    sign_momentum=False,
    cautious=False,
    adjust_lr_fn=None,
    pieces=None,
    ns_steps=5,
    coefficients=JORDAN,
    eps=1e-7,
):
    """One step of Muon (``variant="muon"``), NorMuon or AdaMuon on one parameter, fp32; ``pieces``
    (``(index, transposed)`` each) for a tensor holding several matrices, each with its own
    statistics; ``cautious``: decay only where ``u⊙p ≥ 0`` (arXiv 2510.12402)."""
    U = ema_update(p, g, state, momentum, nesterov)
    if sign_momentum:
        U = U.sign()
    pieces = pieces or [((slice(None),), False)]
    rescale = rescale or ("rms" if variant == "adamuon" else "norm")
    update = torch.zeros_like(p)
    for k, (box, transposed) in enumerate(pieces):
        u = U[box].T if transposed else U[box]
        shape = u.shape
        O = ns_reference(u.reshape(shape[0], -1), ns_steps, coefficients, eps)
        if variant == "normuon":
            v = state.setdefault(("rows", k), torch.zeros(O.shape[0]))
            O = normuon_normalize(O, v, beta2=beta2, eps=moment_eps, rescale=rescale)
        elif variant == "adamuon":
            v = state.setdefault(("elems", k), torch.zeros_like(O))
            O = adamuon_normalize(O, v, beta2=beta2, eps=moment_eps, rescale=rescale)
        factor = 1.0 if rescale == "rms" and variant != "muon" else adjust(adjust_lr_fn or "original", shape)
        O = O.reshape(shape) * factor
        update[box] = O.T if transposed else O
    if cautious:
        p.copy_(p - lr * weight_decay * torch.where(update * p >= 0, p, 0))
    else:
        p.copy_(p * (1 - lr * weight_decay))
    p.copy_(p - lr * update.to(p.dtype))


# ----- interleaved parts: the tensor de-interleaved, then contiguous pieces ----------------------
def deinterleave_order(size: int, parts: int) -> torch.Tensor:
    """The indices of a dim of ``size`` holding ``parts`` interleaved parts (part k: entries
    k, k+parts, k+2·parts, ...), part by part: ``t.index_select(dim, order)`` puts each part's
    entries together, ``t.index_select(dim, order.argsort())`` interleaves them back."""
    return torch.arange(size).view(size // parts, parts).T.reshape(-1)


def deinterleaved(t: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
    return t.index_select(dim, deinterleave_order(t.shape[dim], parts))


def interleaved(t: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
    return t.index_select(dim, deinterleave_order(t.shape[dim], parts).argsort())


# ----- QK-clip (MuonClip, Kimi K2 technical report, arXiv 2507.20534) ------------------------------
def qk_gamma(maxima, tau):
    """Per query head, ``τ / S`` where the head's largest logit ``S`` exceeded ``τ``, else 1."""
    return [tau / s if s > tau else 1.0 for s in [float(v) for v in maxima]]


def qk_clip_reference(query, key, maxima, *, heads, kv_heads, tau, alpha):
    """A query and a key tensor (weights, or biases: rows on dim 0) after QK-clip, fp32: query
    head ``h`` times ``γ_h^α``; key head ``j``, shared by query heads ``j·g … j·g+g−1``
    (``g = heads/kv_heads``), times ``(min of their γ)^(1−α)``."""
    gamma = qk_gamma(maxima, tau)
    q, k = query.detach().to(torch.float32).clone(), key.detach().to(torch.float32).clone()
    rows_q, rows_k = q.shape[0] // heads, k.shape[0] // kv_heads
    group = heads // kv_heads
    for h in range(heads):
        q[h * rows_q : (h + 1) * rows_q] *= gamma[h] ** alpha
    for j in range(kv_heads):
        shared = min(gamma[j * group : (j + 1) * group])
        k[j * rows_k : (j + 1) * rows_k] *= shared ** (1 - alpha)
    return q, k


def mla_qk_clip_reference(query, key_value, maxima, *, heads, nope, rope, v, tau, alpha):
    """MLA's query up-projection (per head ``nope`` content rows, then ``rope`` rotary rows) and
    key/value up-projection (per head ``nope`` key rows, then ``v`` value rows) after QK-clip:
    ``q_C·γ^α``, ``q_R·γ``, ``k_C·γ^(1−α)``, values and the shared rotary key untouched."""
    gamma = qk_gamma(maxima, tau)
    q, kv = query.detach().to(torch.float32).clone(), key_value.detach().to(torch.float32).clone()
    for h in range(heads):
        start = h * (nope + rope)
        q[start : start + nope] *= gamma[h] ** alpha
        q[start + nope : start + nope + rope] *= gamma[h]
        kv[h * (nope + v) : h * (nope + v) + nope] *= gamma[h] ** (1 - alpha)
    return q, kv


def logit_maxima_reference(query, key, scaling, keep):
    """Each query head's largest pre-softmax logit, all heads' logits at once: ``query``
    ``(B, H, Lq, d)``, ``key`` ``(B, K, Lk, d)`` (repeated to ``H`` heads), ``keep`` a boolean
    ``(B, Lq, Lk)`` of the entries attention uses."""
    key = key.to(torch.float64).repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    logits = query.to(torch.float64) @ key.transpose(-1, -2) * scaling
    logits = logits.masked_fill(~keep[:, None], -math.inf)
    return logits.amax(dim=(0, 2, 3))


# ----- state stored in another dtype (state_dtype), the step's arithmetic in fp32 ----------------
def load_stored(state, key, like):
    """A stored buffer as the step computes with it: its value in fp32 (zeros before the first step)."""
    value = state.get(key)
    return torch.zeros(like.shape, dtype=torch.float32) if value is None else value.to(torch.float32)


def ema(M, g, beta):
    """``β·M + (1−β)·g`` in fp32 as ``torch.optim.Muon`` writes it (``M.lerp_(g, 1 − β)``): the
    fp32 value a stored buffer is rounded from must be the one the optimizer computes, or a value
    near a bf16 rounding boundary would round the other way."""
    return torch.lerp(M, g.float(), 1 - beta)


def muon_stored_reference_step(
    p,
    g,
    state,
    *,
    state_dtype,
    lr,
    momentum,
    nesterov,
    weight_decay,
    adjust_lr_fn=None,
    ns_steps=5,
    coefficients=JORDAN,
    eps=1e-7,
):
    """One Muon step on one matrix with its momentum stored in ``state_dtype``: ``M`` read in
    fp32, ``M ← β·M + (1−β)·g`` in fp32 (:func:`ema`), stored rounded to nearest; the update (Nesterov:
    ``β·M + (1−β)·g``) from the unrounded fp32 ``M``."""
    beta = momentum
    M = ema(load_stored(state, "momentum_buffer", p), g, beta)
    state["momentum_buffer"] = M.to(state_dtype)
    U = beta * M + (1 - beta) * g.float() if nesterov else M
    O = ns_reference(U.reshape(U.shape[0], -1), ns_steps, coefficients, eps).reshape(p.shape)
    p.copy_(p * (1 - lr * weight_decay))
    p.copy_(p - lr * adjust(adjust_lr_fn or "original", p.shape) * O.to(p.dtype))


def adamw_stored_reference_step(
    p, g, state, *, state_dtype, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
):
    """AdamW with ``exp_avg`` and ``exp_avg_sq`` stored in ``state_dtype``, computed in fp32 from
    their stored values, the update from the unrounded moments."""
    b1, b2 = betas
    t = state["t"] = state.get("t", 0) + 1
    g = g.float()
    m = b1 * load_stored(state, "m", p) + (1 - b1) * g
    v = b2 * load_stored(state, "v", p) + (1 - b2) * g * g
    state["m"], state["v"] = m.to(state_dtype), v.to(state_dtype)
    p.copy_(p * (1 - lr * weight_decay))
    p.copy_(p - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps))


def musgd_stored_reference_step(
    p,
    g,
    state,
    *,
    state_dtype,
    lr,
    momentum,
    nesterov,
    weight_decay,
    muon,
    sgd,
    use_muon,
    adjust_lr="ultralytics",
    ns_steps=5,
    coefficients=JORDAN,
    eps=1e-7,
):
    """One MuSGD step on one parameter with both momentum buffers stored in ``state_dtype``."""
    beta = momentum
    g32 = g.float()
    muon_group = use_muon if use_muon is not None else p.ndim >= 2
    if muon_group and p.ndim >= 2:
        M = ema(load_stored(state, "momentum_buffer", p), g32, beta)
        state["momentum_buffer"] = M.to(state_dtype)
        U = beta * M + (1 - beta) * g32 if nesterov else M
        O = ns_reference(U.reshape(U.shape[0], -1), ns_steps, coefficients, eps).reshape(p.shape)
        p.copy_(p - lr * muon * O.to(p.dtype) * adjust(adjust_lr, p.shape))
    key = "momentum_buffer_SGD" if muon_group else "momentum_buffer"
    g2 = g32 + weight_decay * p.float()
    B = beta * load_stored(state, key, p) + g2
    state[key] = B.to(state_dtype)
    upd = g2 + beta * B if nesterov else B
    p.copy_(p - lr * (sgd if muon_group else 1.0) * upd)


def variant_stored_reference_step(
    p,
    g,
    state,
    *,
    variant,
    state_dtype,
    lr,
    momentum,
    nesterov,
    weight_decay,
    beta2=0.95,
    moment_eps=1e-8,
    rescale=None,
    sign_momentum=False,
    adjust_lr_fn=None,
    ns_steps=5,
    coefficients=JORDAN,
    eps=1e-7,
):
    """NorMuon or AdaMuon on one 2-D matrix with ``M`` and ``v`` stored in ``state_dtype``: each
    read in fp32, stepped in fp32, stored rounded; the update from the unrounded values."""
    beta = momentum
    M = ema(load_stored(state, "momentum_buffer", p), g, beta)
    state["momentum_buffer"] = M.to(state_dtype)
    U = beta * M + (1 - beta) * g.float() if nesterov else M
    if sign_momentum:
        U = U.sign()
    rescale = rescale or ("rms" if variant == "adamuon" else "norm")
    O = ns_reference(U, ns_steps, coefficients, eps)
    if variant == "normuon":
        v = load_stored(state, "v", torch.empty(O.shape[0]))
        O = normuon_normalize(O, v, beta2=beta2, eps=moment_eps, rescale=rescale)
    else:
        v = load_stored(state, "v", O)
        O = adamuon_normalize(O, v, beta2=beta2, eps=moment_eps, rescale=rescale)
    state["v"] = v.to(state_dtype)
    factor = 1.0 if rescale == "rms" else adjust(adjust_lr_fn or "original", p.shape)
    p.copy_(p * (1 - lr * weight_decay))
    p.copy_(p - lr * (O * factor).to(p.dtype))
