"""One benchmark for DFlash speculative decoding: ``python -m bench --help``.

Importable pieces: ``bench.stats`` (the tau / per-slot / histogram definitions), ``bench.prompts``
(prompt sources, dataset adapters, chat template, length sweep), ``bench.contenders`` (what is
measured), ``bench.core`` (interleaved timing, summary, table, plot), ``bench.cli`` (the command).
"""
