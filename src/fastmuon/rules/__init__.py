"""Update rules: what each optimizer computes, one module per rule.

A rule is a module (or, where one parametrised rule serves several optimizers, an object) each
optimizer class names (read as ``opt.rule``); it satisfies
:class:`fastmuon.step.contracts.Rule` (mypy checks what a class names). It says, for its family
of optimizers:

- ``family``: its name in checkpoints (see :mod:`fastmuon.optim.checkpoint`);
- ``other_update``: what the parameters it does not orthogonalise take ("SGD", "AdamW"), as
  warnings and plan notes name it;
- ``state_keys``: each state entry it may keep and how it is shaped (read by the loader);
- ``is_matrix(group, p)``, ``state_roles(group, p)`` and ``state_shapes(group, p, map)``: what it
  orthogonalises, what each buffer it keeps holds, and the shapes not simply ``p``'s;
- ``collect(groups, grads, env)``: a step's work items (``Items``: ``matrices`` and
  ``elementwise``), creating missing state;
- ``scalars(groups, lr_value)``: the step's pattern (the hyperparameters' equality classes, which
  decide whether a prepared program still fits) and its scalars, as named fields;
- ``build(items, pattern, engine_for, options)``: the batched program for those items;
- ``reference(items)``: the same update one parameter at a time (``foreach=False``).

A variant is a rule and its optimizer class: it builds on another rule's collection
and program, adding the stages of :mod:`fastmuon.step` it needs (a second moment after NS,
:mod:`fastmuon.step.moments`; the momentum's sign before it, :mod:`fastmuon.step.before_ns`):
NorMuon and AdaMuon are :mod:`fastmuon.rules.second_moment`'s two instances.
"""
