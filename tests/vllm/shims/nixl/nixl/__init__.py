"""``nixl`` resolving to kvring.nixl: put this folder's parent on the path
(PYTHONPATH) in place of NIXL's wheel, and ``nixl._api`` / ``nixl._bindings``
are kvring's. A user's switch, with no change to the engine's code."""
