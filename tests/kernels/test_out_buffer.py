"""Every launcher's optional ``out``: used when it fits, refused with the op's name when not."""

import pytest
import torch

from deepinfer_fx.kernels.triton.buffers import out_buffer
from deepinfer_fx.kernels.triton.indexer import topk_mask_triton


def test_fitting_out_is_used_and_none_allocates() -> None:
    out = torch.empty(3, 4)
    assert out_buffer(out, (3, 4), torch.float32, out.device, "op") is out
    fresh = out_buffer(None, torch.Size([2, 5]), torch.bool, out.device, "op")
    assert fresh.shape == (2, 5) and fresh.dtype == torch.bool and fresh.is_contiguous()


@pytest.mark.parametrize(
    "bad",
    [torch.empty(4, 3), torch.empty(3, 4, dtype=torch.float64), torch.empty(4, 3).T],
    ids=["shape", "dtype", "strided"],
)
def test_unfitting_out_names_the_op(bad: torch.Tensor) -> None:
    with pytest.raises(ValueError, match=r"myop: out must be a contiguous torch.float32 tensor of shape \(3, 4\)"):
        out_buffer(bad, (3, 4), torch.float32, bad.device, "myop")


def test_a_launcher_refuses_a_wrong_out(device: str) -> None:
    scores = torch.randn(4, 16, device=device)
    with pytest.raises(ValueError, match="topk_mask: out must be"):
        topk_mask_triton(scores, 3, out=torch.empty(4, 8, dtype=torch.bool, device=device))
