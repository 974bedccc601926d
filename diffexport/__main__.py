from diffexport.cli import main

raise SystemExit(main())
