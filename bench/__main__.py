"""``python -m bench``: the benchmarks' list, one of them, or every quick run
(:mod:`bench.cli`, from :mod:`bench.catalog`)."""

from bench.cli import main

raise SystemExit(main())
