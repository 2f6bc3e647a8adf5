"""``python -m bench.capacity``: the same as ``tokenrelay capacity``."""

from bench.capacity.cli import main

raise SystemExit(main())
