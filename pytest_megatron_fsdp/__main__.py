"""``python -m pytest_megatron_fsdp``: the post-mortem command line (see :mod:`.postmortem`)."""

from __future__ import annotations

import sys

from .postmortem import main

if __name__ == "__main__":
    sys.exit(main())
