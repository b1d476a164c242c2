from services.runtime.kernels.cpu import main

raise SystemExit(main())
