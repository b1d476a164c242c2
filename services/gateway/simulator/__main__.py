from services.gateway.simulator.main import main

raise SystemExit(main())
