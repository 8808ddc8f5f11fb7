"""`python -m asynchicache.storage.service`: the cache service as a process of its own."""

from asynchicache.storage.service.cli import main

raise SystemExit(main())
