"""`python -m backends.sim`: run simulated engine replicas."""

from backends.sim.cli import main

raise SystemExit(main())
