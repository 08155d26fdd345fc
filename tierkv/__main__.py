"""``python -m tierkv``: the ``tierkv`` console command (:mod:`tierkv.cli`)."""

from tierkv.cli import main

raise SystemExit(main())
