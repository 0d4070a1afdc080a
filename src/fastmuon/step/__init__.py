"""A prepared step: built once per step shape, then only run.

- :mod:`.contracts`: what a rule, its program and an engine offer each other (Protocols);
- :mod:`.driver`: one call of ``step()``: where it runs, its gradients, the kept or a freshly
  prepared program, the run; :mod:`.cache` keeps the programs and engines between calls;
- :mod:`.program`, :mod:`.collecting`: the pieces of a program (what is prepared once, what is
  read each step) and what every rule's collection reads;
- the matrix half: :mod:`.matrix` (momentum, NS through an engine, scale, apply), its items
  (:mod:`.matrix_item`), the stages a rule may add before NS (:mod:`.before_ns`) and after it
  (:mod:`.moments`, a second moment), and :mod:`.after_ns` (decay, scale and apply, bucket by
  bucket on a CPU);
- the other half: :mod:`.sgd` and :mod:`.adamw`, over the fused steps of :mod:`.elementwise`;
- what can go wrong: :mod:`.nonfinite` (raise, skip or ignore a NaN/Inf gradient),
  :mod:`.deferred` (the verdict read one call later on an accelerator), :mod:`.state_marks`
  (a refused step takes back the state it added);
- :mod:`.state_dtype` (buffers in a dtype other than their parameter's). QK-clip (MuonClip's
  per-head scaling of attention rows) is :mod:`fastmuon.optim.qk_clip`.
"""
