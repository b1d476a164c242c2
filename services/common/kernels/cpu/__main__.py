from services.common.kernels.cpu import main

raise SystemExit(main())
