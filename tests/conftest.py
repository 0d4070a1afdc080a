import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max elementwise error relative to the reference's largest magnitude."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# Shapes that cover every case the engine distinguishes: conv, tall, wide, square, 1xn,
# depthwise, 1x1 conv, and repeats (stacking without padding).
MIXED_SHAPES = [
    (16, 3, 3, 3),
    (32, 16, 3, 3),
    (32, 16, 3, 3),
    (64, 32, 1, 1),
    (100, 20),
    (20, 100),
    (48, 48),
    (1, 50),
    (50, 1),
    (8, 1, 3, 3),
    (8, 1, 3, 3),
    (24, 8, 1, 1),
]


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (all of them: pytest -m cuda)")


def pytest_collection_modifyitems(items):
    """Mark the tests that need CUDA (skipped unless CUDA is there, or run on a "cuda" device)."""
    for item in items:
        skip_reasons = (str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))
        callspec = getattr(item, "callspec", None)
        on_cuda = callspec is not None and "cuda" in map(str, callspec.params.values())
        if on_cuda or any("needs CUDA" in reason for reason in skip_reasons):
            item.add_marker(pytest.mark.cuda)


@pytest.fixture
def one_rank_world():
    """A one-process gloo world (the default group), destroyed after the test."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
