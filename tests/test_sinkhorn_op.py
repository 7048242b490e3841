"""``dsv4_mtp::sinkhorn``: the op's registrations agree with the reference math."""

import pytest
import torch

from dsv4_mtp_hf.ops.sinkhorn import sinkhorn, sinkhorn_op, sinkhorn_reference


SEED = 5


@pytest.fixture(autouse=True)
def _seeded():
    """Draws from torch's global generator are seeded here (replay a failure with this seed)."""
    print(f"seed={SEED}")
    torch.manual_seed(SEED)


def test_cpu_op_and_dispatch_equal_the_reference():
    logits = torch.randn(3, 5, 4, 4) * 2
    want = sinkhorn_reference(logits, 20, 1e-6)
    assert torch.equal(sinkhorn_op(logits, 20, 1e-6), want)
    assert torch.equal(sinkhorn(logits, 20, 1e-6), want)
    g = logits.clone().requires_grad_()
    sinkhorn(g, 20, 1e-6).sum().backward()  # the training path keeps autograd
    assert g.grad is not None and torch.isfinite(g.grad).all()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1, 4, 4), (2, 37, 4, 4), (3000, 4, 4), (5, 8, 8), (4, 3, 3)])
def test_cuda_kernel_matches_the_reference(shape):
    logits = (torch.randn(shape) * 3).cuda()
    got = sinkhorn_op(logits, 20, 1e-6)
    want = sinkhorn_reference(logits.double(), 20, 1e-6)
    assert torch.isfinite(got).all() and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
