import sys

from distattn.memory.plan import main

sys.exit(main())
