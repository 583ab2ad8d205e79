"""Mooncake's own transfer-engine Python tests (kvcache-ai/Mooncake,
mooncake-wheel/tests), rewritten here with the same steps and assertions:
Mooncake ships them in its git repository only, not in a wheel or sdist a
CI run could fetch. They import ``mooncake.engine`` as Mooncake's do; the
shim folder put first on the path (and on PYTHONPATH, for the processes
they start) makes that kvring.mooncake, as a user would switch it."""

import os
import sys

SHIM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shims", "mooncake")
sys.path.insert(0, SHIM)
os.environ["PYTHONPATH"] = os.pathsep.join([SHIM] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def pytest_report_header(config):
    import mooncake.engine

    return f"mooncake.engine is {mooncake.engine.TransferEngine.__module__}.TransferEngine"
