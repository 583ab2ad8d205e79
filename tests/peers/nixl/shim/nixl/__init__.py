"""A ``nixl`` package that is kvring.nixl: put its parent folder first on
``PYTHONPATH`` and code written for NIXL (``import nixl._api``,
``nixl._bindings``, ``nixl._utils``, ``nixl.logging``) runs on kvring,
unchanged. This is the switch a user makes; NIXL's own tests are run
through it (tests/peers/nixl/run.py)."""

import sys

from kvring.nixl import install_as_nixl

install_as_nixl(sys.modules[__name__])
