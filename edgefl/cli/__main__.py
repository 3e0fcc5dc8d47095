"""`python -m edgefl.cli`: what the systemd units' ExecStart runs (the `edgefl` script's
console_main)."""
import sys

from . import console_main

sys.exit(console_main())
