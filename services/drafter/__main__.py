from services.drafter.main import main

raise SystemExit(main())
