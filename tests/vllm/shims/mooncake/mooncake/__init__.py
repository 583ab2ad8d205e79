"""``mooncake`` resolving to kvring.mooncake: put this folder's parent on the
path (PYTHONPATH) in place of Mooncake's wheel, and ``mooncake.engine`` is
kvring's. A user's switch, with no change to the engine's code."""
