from consumer.app.cli import main

raise SystemExit(main())
