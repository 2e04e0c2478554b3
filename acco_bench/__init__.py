"""acco-bench: the benchmarks of acco, a package of its own beside the library.

The library (``acco``) never imports it. The subcommands are in :mod:`acco_bench.cli`; what one
run is, in :mod:`acco_bench.settings`; the emulated network the workers run on, in
:mod:`acco_bench.network`; the plain reference of the methods' recurrences (shared with the
tests), in :mod:`acco_bench.reference`; ``make demo`` is :mod:`acco_bench.demo`.
"""


class BenchError(RuntimeError):
    """A benchmark that cannot run as asked (no namespaces, a worker failed, a timeout)."""
