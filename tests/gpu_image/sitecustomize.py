"""Put on ``PYTHONPATH`` by ``tests/test_gpu_image.py``: the lent GPU machine's image, as far as imports go. Its
Python has no ``datasets``, ``mlflow``, ``onnxruntime-extensions`` or ``tensorrt``: here they import as absent (an
import raises ModuleNotFoundError, ``importlib.util.find_spec`` returns None, their distributions have no metadata)."""

import importlib.metadata as md
import importlib.util
import sys

BLOCKED = {"datasets", "mlflow", "onnxruntime_extensions", "tensorrt"}
DISTS = {"datasets", "mlflow", "mlflow-skinny", "onnxruntime-extensions", "tensorrt"}


def _blocked(name):
    return name.split(".")[0] in BLOCKED


class _Block:
    def find_spec(self, name, path=None, target=None):
        if _blocked(name):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: None if _blocked(name) else _find_spec(name, package)
_distribution = md.distribution


def _dist(name):
    if name.lower().replace("_", "-") in DISTS:
        raise md.PackageNotFoundError(name)
    return _distribution(name)


md.distribution = _dist
md.version = lambda name: _dist(name).version
sys.meta_path.insert(0, _Block())
