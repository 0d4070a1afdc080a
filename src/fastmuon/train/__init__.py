"""``fastmuon train``: a convergence comparison on data every machine already has.

Modules: ``data`` (digits, stdlib-source corpus), ``models`` (CNN, char transformer), ``tasks``
(data + model + loss + evaluation), ``contenders`` (the optimizers and their hyperparameters),
``loop`` (one timed run), ``report`` (table, JSON, plot), ``cli`` (the subcommand).
"""
