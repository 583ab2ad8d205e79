"""Mooncake's ``mooncake.engine`` names, from kvring.mooncake."""

from kvring.mooncake import *  # noqa: F401,F403
from kvring.mooncake import TransferEngine, TransferNotify, TransferOpcode  # noqa: F401
