from offloadd.cli import main

raise SystemExit(main())
