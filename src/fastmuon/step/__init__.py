"""A prepared step: built once per step shape, then only run.

- :mod:`.contracts` (what a rule, its stages and an engine offer each other), :mod:`.options`, :mod:`.driver`
  (one call of ``step()``, with its program cache), :mod:`.collecting` (what rules collect from);
- the matrix half: :mod:`.matrix`, :mod:`.matrix_item`, :mod:`.bucket_momentum`, the stages a rule
  may add before NS (:mod:`.before_ns`) and after it (:mod:`.moments`);
- the other half: :mod:`.sgd` and :mod:`.adamw`, over the fused steps of :mod:`.elementwise`;
- what can go wrong: :mod:`.nonfinite`, :mod:`.deferred`, :mod:`.state_marks`; :mod:`.state_dtype`
  (buffers in a dtype other than their parameter's). QK-clip is :mod:`fastmuon.optim.qk_clip`."""
