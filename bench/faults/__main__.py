"""``python -m bench.faults``: the fault suite (:mod:`bench.faults.drills`)."""

from bench.faults.drills import main

raise SystemExit(main())
