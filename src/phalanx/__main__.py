from phalanx.cli.main import main

raise SystemExit(main())
