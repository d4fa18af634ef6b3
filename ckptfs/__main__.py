from ckptfs.cli import main

raise SystemExit(main())
