"""`python -m edgeflow.cli` is the `edgeflow` command."""
from edgeflow.cli.main import main

raise SystemExit(main())
