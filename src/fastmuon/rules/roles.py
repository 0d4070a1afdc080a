"""The vocabulary checkpoints are translated in: which optimizer family wrote a state dict, and
what recurrence each state buffer follows (see :mod:`fastmuon.optim.checkpoint`)."""

# families: the optimizers whose state dicts load
SGD, ADAM, MUON, MUSGD = "sgd", "adam", "muon", "musgd"

# roles: the recurrence a buffer follows (g the gradient, p the parameter, β the momentum)
EMA = "ema"  # M ← β·M + (1−β)·g
HEAVY_BALL = "heavy_ball"  # B ← β·B + g + wd·p
ADAM_AVG = "adam_avg"  # AdamW's exp_avg
ADAM_AVG_SQ = "adam_avg_sq"  # AdamW's exp_avg_sq
ADAM_STEP = "adam_step"  # AdamW's step count
# second moments of the orthogonalised update O (see fastmuon.rules.second_moment)
ROW_MOMENT = "row_moment"  # NorMuon's v ← β₂·v + (1−β₂)·mean_cols(O⊙O), one entry per row
ELEMENT_MOMENT = "element_moment"  # AdaMuon's v ← β₂·v + (1−β₂)·O⊙O, O of sign(M) or M
