"""NIXL's ``nixl._api`` names, from kvring.nixl."""

from kvring.nixl import *  # noqa: F401,F403
from kvring.nixl import nixl_agent, nixl_agent_config  # noqa: F401
