from hyperpod_sim.cli.main import main

raise SystemExit(main())
