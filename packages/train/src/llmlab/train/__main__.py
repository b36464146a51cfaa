"""``python -m llmlab.train experiment=<name> [key=value ...]``."""

from llmlab.train.app import main

raise SystemExit(main())
