import sys

from distattn.memory.cli import main

sys.exit(main())
