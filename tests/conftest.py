import os
from pathlib import Path

import pytest
import torch

import kvforge

REPO = Path(__file__).resolve().parents[1]
if Path(kvforge.__file__).resolve().parent != REPO:
    # Two checkouts, one environment: the last `pip install -e` owns the name `kvforge`.
    raise pytest.UsageError(f"kvforge is imported from {Path(kvforge.__file__).parent}, not from this "
                            f"checkout ({REPO}): run `pip install -e .` here first")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a GPU (run `pytest -m gpu` on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _private_kernel_cache(tmp_path_factory):
    """Tests build into their own cache unless KVFORGE_CACHE_DIR says otherwise."""
    if "KVFORGE_CACHE_DIR" not in os.environ:
        os.environ["KVFORGE_CACHE_DIR"] = str(tmp_path_factory.mktemp("kvforge-cache"))
    yield
