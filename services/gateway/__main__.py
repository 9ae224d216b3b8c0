"""`python -m services.gateway --model DIR ...` (the same as `corral gateway`)."""

from services.gateway.server import main

raise SystemExit(main())
