from sparkwatch.cli import main

raise SystemExit(main())
