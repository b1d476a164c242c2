from benchmarks.gateway.driver import main

raise SystemExit(main())
