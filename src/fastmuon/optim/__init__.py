"""The optimizer classes users build, and what they check and keep.

- :mod:`.base`: :class:`~.base.MatrixOptimizer`, what every class shares: groups checked whole
  before they are stored, the step handed to :mod:`fastmuon.step` as a ``StepEnv``, state dicts,
  copies and pickles;
- :mod:`.musgd`, :mod:`.muon`, :mod:`.normuon`: the constructors (Muon's options declared once,
  the variants' signatures made from it) and each family's group checks; the updates themselves
  are :mod:`fastmuon.rules`;
- :mod:`.options`: the optimizer-wide settings, fixed at construction in one frozen object;
- :mod:`.validation`: the checks of arguments, group values, parameters and gradients, each
  naming what is wrong and the fix;
- :mod:`.checkpoint` and :mod:`.state`: loading state dicts saved by other optimizers and
  checking a state against the parameters it is loaded into (the state keys each rule declares);
- :mod:`.param_names`, :mod:`.share`, :mod:`.qk_clip`: named groups, the notes on what Muon
  takes, and QK-clip's options and its clip after a step.
"""
