from sparkwatch.guard.process import main

raise SystemExit(main())
