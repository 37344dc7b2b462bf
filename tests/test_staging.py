"""Staging buffers are reused across calls and grow only when needed."""
import torch

from moecc.staging import StagingBuffers


def test_buffers_are_reused_and_grow():
    staging = StagingBuffers(torch.device("cpu"))
    first = staging.view("hidden", (4, 8), torch.bfloat16)
    again = staging.view("hidden", (2, 8), torch.float32)
    assert again.data_ptr() == first.data_ptr()
    bigger = staging.view("hidden", (64, 64), torch.float32)
    assert bigger.shape == (64, 64) and bigger.dtype == torch.float32


def test_to_host_copies_values():
    staging = StagingBuffers(torch.device("cpu"))
    source = {"hidden": torch.randn(5, 3), "top_k_index": torch.tensor([[1, 2]] * 5)}
    views = staging.to_host(source).wait()
    for role, tensor in source.items():
        assert torch.equal(views[role], tensor)
        assert views[role].data_ptr() != tensor.data_ptr()
    assert staging.bytes_to_host == sum(t.nbytes for t in source.values())
