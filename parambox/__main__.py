from parambox.cli import main

raise SystemExit(main())
