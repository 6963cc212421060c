"""`python -m edgeflow.fleet`: the `edgeflow fleet` command (edgeflow/cli/fleet.py), as a device's systemd unit runs it.

A program, not a module anything imports: it sits on the cli layer wherever it lives (tests/test_import_layers.py).
"""
import sys

from edgeflow.cli.fleet import main

if __name__ == "__main__":
    sys.exit(main())
