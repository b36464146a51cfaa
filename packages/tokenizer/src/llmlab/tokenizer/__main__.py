import sys

from llmlab.tokenizer.cli import main

sys.exit(main())
