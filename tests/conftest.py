import os

import pytest
import torch


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
