"""``python -m devstack`` is the development stack's command (:mod:`devstack.cli`)."""

from devstack.cli import main

raise SystemExit(main())
