from radixserve.router.cli import main

raise SystemExit(main())
