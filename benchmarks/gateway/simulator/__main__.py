from benchmarks.gateway.simulator.main import main

raise SystemExit(main())
