"""A workaround for a vLLM defect on hosts with no accelerator, for the
MooncakeConnector servers only (tests/vllm/vllm_servers.py puts this folder
on their PYTHONPATH; nothing of kvring's is involved).

vLLM 0.32's ``MooncakeConnectorWorker.__init__`` (mooncake_connector.py)
calls ``torch.accelerator.current_device_index()``, which raises where no
accelerator is usable (a CUDA build of torch: "Found no NVIDIA driver"; a
CPU build: no accelerator at all), and then hands the index to
``current_platform.set_device``, which vLLM's CPU platform passes to
``torch.cpu.set_device``, a no-op. So on a CPU host the connector cannot
start, whatever transfer engine is under it. Here the call answers 0 when
torch has no usable accelerator, and is untouched otherwise; the patch is
applied when ``torch.accelerator`` is first imported, so nothing else is
imported early."""

import importlib.abc
import importlib.util
import sys


def _patch(module):
    original = module.current_device_index

    def current_device_index():
        if not module.is_available():
            return 0  # vLLM's CPU platform ignores the index
        return original()

    current_device_index.__doc__ = original.__doc__
    module.current_device_index = current_device_index


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.accelerator":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _Finder())
