"""``python -m tokenrelay`` is the ``tokenrelay`` command."""

from tokenrelay.cli import main

raise SystemExit(main())
