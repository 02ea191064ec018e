from sparkwatch.telemetry.process import main

raise SystemExit(main())
