"""``python -m distattn.schedule``: see ``distattn.schedule.cli``."""

from distattn.schedule.cli import main

main()
