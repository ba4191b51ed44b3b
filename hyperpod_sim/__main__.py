from hyperpod_sim.cli import main

raise SystemExit(main())
