"""``ppbackward bench``'s measurements: the stage-backward benchmark (time and memory, upstream vs ours).

Private package. The command (options, validation, the run) is ``ppbackward._tools.cli.bench``, which
``ppbackward bench``, ``python -m ppbackward._tools.bench`` and ``benchmarks/bench_backward.py`` all call.
Modules: ``impls`` (the variants timed), ``timing`` (interleaved min-of-N, the device clock, the load
average), ``memory`` (saved activations held between B and W against what W reads), ``loop`` (one stage pair's
microbatch loop in a zero-bubble schedule's order), ``alloc`` (the allocator's work), ``scaling`` (graph
analysis time against graph size), ``profile`` (where the time of B and W goes), ``quiet`` (torch.profiler's
chatter kept off the terminal, for ``alloc`` and ``profile``), ``device_work`` (the device work counted), the
schedule steps under torchrun (in the harness: ``ppbackward._tools.harness.schedule_bench``), ``split`` and
``replay`` (the split's cost per microbatch-stage, and a schedule step replayed from it: ``--split``),
``compiled`` (the split's cost with every layer ``torch.compile``'d: ``--compile``), ``one_rank`` (the
one-rank step), ``trace`` and ``plots`` (Chrome traces, PNGs), ``report`` (targets, tables, JSON). The
configurations and their models are entries of the tooling's one model zoo,
``ppbackward._tools.harness.models`` (Note [bench configurations] there). Method and results:
``docs/performance.md``.

Note [tooling layers]: the library (``ppbackward``: the stage backward, ``leaks``, the pytest plugin)
is at the bottom and never imports ``ppbackward._tools``; only ``ppbackward/__main__.py``, the console
script, does. Inside ``_tools``, from the top: the command line (``cli``), the measurements (this
package), the harness (its zoo, its worker and launcher, which the bench's schedule step runs), then the
helpers every one of them may use (``torchrun``, ``text_table``, ``memory``, ``repeats``). No layer
imports one above it, not even inside a function: this package's one exception is ``__main__``
(``python -m ppbackward._tools.bench``), a program's entry that nothing imports. No circle anywhere in
``_tools`` (what two modules share lives in a lower one: ``timing``'s clock and load average,
``repeats``' order of the repeats). ``tests/bench/test_import_structure.py`` reads every import with
``ast`` and holds these rules.
"""

__all__: list[str] = []
