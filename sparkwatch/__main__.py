from sparkwatch.entry import main

raise SystemExit(main())
