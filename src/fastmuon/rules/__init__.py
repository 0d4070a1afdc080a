"""Update rules: what each optimizer computes, one module per rule. A rule is a module (or, where
one parametrised rule serves several optimizers, an object) that an optimizer class names
(``opt.rule``), satisfying :class:`fastmuon.step.contracts.Rule`. A variant builds on another rule's
collection and program, adding the stages of :mod:`fastmuon.step` it needs (a second moment after
NS, :mod:`fastmuon.step.moments`; the momentum's sign before it, :mod:`fastmuon.step.before_ns`):
NorMuon and AdaMuon are :mod:`.second_moment`'s two instances."""
