"""Log each test phase's outcome and duration as the controller receives it (survives an interrupted run)."""
import os
import time

_PATH = os.environ.get("DURPLUG_OUT", "/tmp/cov40/durations.tsv")


def pytest_runtest_logreport(report):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller logs
    with open(_PATH, "a") as f:
        f.write(f"{time.time():.0f}\t{report.nodeid}\t{report.when}\t{report.outcome}\t{report.duration:.2f}\n")
