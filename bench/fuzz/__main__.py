"""``python -m bench.fuzz``: the fuzz run (:mod:`bench.fuzz.run`)."""

from bench.fuzz.run import main

raise SystemExit(main())
