"""The optimizer classes users build (:mod:`.muon`, :mod:`.musgd`, :mod:`.normuon`, on what
:mod:`.base` shares), what they check (:mod:`.validation`, :mod:`.qk_clip`) and what they load
(:mod:`.checkpoint`, :mod:`.state`); the updates themselves are :mod:`fastmuon.rules`."""
