"""The ``tokenrelay`` command: one entry point whose subcommands the packages add."""
