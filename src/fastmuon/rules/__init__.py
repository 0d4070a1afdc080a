"""Update rules: what each optimizer computes, one module per rule.

A rule is a small object each optimizer class names (read as ``opt.rule``). It says, for
its family of optimizers:

- ``family``: its name in checkpoints (see :mod:`fastmuon.optim.checkpoint`);
- ``elementwise``: what the parameters it does not orthogonalise take ("SGD", "AdamW"), as
  warnings and plan notes name it;
- ``is_matrix(group, p)`` and ``state_roles(group, p)``: what it orthogonalises, and what each
  state buffer it keeps holds;
- ``collect(groups, grads, env)``: a step's work items (``Items``, one list per half: the
  matrices first), creating missing state;
- ``scalars(groups, lr_value)``: the step's hyperparameters as named fields, and the pattern
  (their equality classes) that decides whether a prepared program still fits;
- ``build(items, pattern, engine_for, options)``: the batched program for those items;
- ``reference(items)``: the same update one parameter at a time (``foreach=False``).

A new hyperparameter or variant is a change to one rule module and its optimizer's validation.
"""
