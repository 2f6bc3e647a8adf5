"""The one benchmark harness: flags from a dataclass (:mod:`bench.harness.flags`), the
stack a benchmark measures, stopped by pid (:mod:`bench.harness.stack`), and one report
writer (:mod:`bench.harness.report`)."""

from bench.harness.flags import Bench, Common, OnCluster, Outcome, flag
from bench.harness.report import cell, markdown_table, text_table, write_result
from bench.harness.stack import BenchStack, Served, bench_stack

__all__ = [
    "Bench",
    "BenchStack",
    "Common",
    "OnCluster",
    "Outcome",
    "Served",
    "bench_stack",
    "cell",
    "flag",
    "markdown_table",
    "text_table",
    "write_result",
]
