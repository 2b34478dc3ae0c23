"""`python -m consumer`: the serversync command."""

from consumer.app.cli import main

raise SystemExit(main())
