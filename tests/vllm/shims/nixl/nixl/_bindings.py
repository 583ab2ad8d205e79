"""NIXL's ``nixl._bindings`` names, from kvring.nixl."""

from kvring.nixl import *  # noqa: F401,F403
from kvring.nixl import nixlXferTelemetry  # noqa: F401
