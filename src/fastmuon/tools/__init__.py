"""The ``fastmuon`` command: its entry point (:mod:`.cli`), the NS accuracy report
(:mod:`.accuracy`) and the plain-text and Markdown tables every report prints (:mod:`.tables`).
The subcommands' own work lives with what they measure: ``bench`` in :mod:`fastmuon.bench`,
``plan`` in :mod:`fastmuon.scale`, ``train`` in :mod:`fastmuon.train`."""
