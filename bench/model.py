"""``python bench/model.py <command>``: the cost model's face and command; nothing is defined here.

The model -- its derivations (the paper's Sec. 3.4 communication accounting, load balance, time per iteration), the
assumed defaults and every formula -- is ``bench/cost_model.py``, whose names this module hands on
(``from bench.model import predict`` keeps working); the commands (``claims``, ``plots``, ``validate``, ``measure``)
are ``bench/model_report.py``, which imports the model room, never this face, so the two import one way.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` and ``distattn`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cost_model import *  # noqa: E402,F401,F403 - the face hands the model's public names on
from bench.cost_model import __all__  # noqa: E402,F401

if __name__ == "__main__":
    from bench.model_report import main

    main()
