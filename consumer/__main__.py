from consumer.cli import main

raise SystemExit(main())
