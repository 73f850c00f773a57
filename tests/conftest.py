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
    """Tests build into their own cache unless KVFORGE_CACHE_DIR says otherwise: one for the
    run, shared by its xdist workers (the cache's per-library locks make that safe), so a
    library one worker built is not compiled again by another."""
    if "KVFORGE_CACHE_DIR" not in os.environ:
        base = tmp_path_factory.getbasetemp()
        run = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
        (run / "kvforge-cache").mkdir(exist_ok=True)
        os.environ["KVFORGE_CACHE_DIR"] = str(run / "kvforge-cache")
    yield
