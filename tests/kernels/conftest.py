import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Kernel tests run torch ops (references, oracles, wrappers' layout ops) on one thread: on the shared
    2-core machine two intra-op threads per pytest worker only contend (a production MoE backward
    oracle took 4x longer wall-clock with torch's default two threads under load)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
