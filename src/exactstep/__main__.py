"""``python -m exactstep`` is the ``exactstep`` command (torchrun launches it this way)."""

from exactstep.cli import main

raise SystemExit(main())
