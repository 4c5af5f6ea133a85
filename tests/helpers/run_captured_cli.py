"""A script that runs one command through scripts/lib/launch.py's ``run_captured``, as the benchmarks do:
what tests/test_launch_cleanup.py signals (SIGTERM, Ctrl-C's SIGINT) while the command's ranks hang.

    python tests/helpers/run_captured_cli.py TIMEOUT_S COMMAND...
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.lib.launch import run_captured  # noqa: E402

if __name__ == "__main__":
    stdout, stderr, code = run_captured(sys.argv[2:], float(sys.argv[1]))
    print(f"exit code {code}\n{stdout}{stderr}")
