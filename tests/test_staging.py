"""Staging buffers are reused across calls and grow only when needed."""
import pytest
import torch

from moecc.staging import StagingBuffers, device_alias


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


def test_read_on_device_without_cuda_hands_the_host_tensors():
    staging = StagingBuffers(torch.device("cpu"))
    a, b = torch.randn(3, 4), torch.arange(6)
    seen = staging.read_on_device({"a": a, "b": b}, lambda a, b: (a.data_ptr(), b.sum().item()))
    assert seen == (a.data_ptr(), 15)
    assert staging.bytes_to_device == a.nbytes + b.nbytes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, device", [(torch.bfloat16, None), (torch.float32, None), (torch.int64, None),
                                           (torch.uint8, None), (torch.float32, "cuda")])
def test_read_on_device_kernels_read_the_values_in_place(dtype, device):
    """Also for a device named without its number (``device="cuda"``), which read through copies on the host."""
    staging = StagingBuffers(torch.device(device or f"cuda:{torch.cuda.current_device()}"))
    hosts, results = [], []
    for step in range(3):  # the same role's buffer reused while the device is busy: each round reads its own
        torch.cuda._sleep(50_000_000)
        hosts.append((torch.randn(37, 5) * 10).to(dtype) + step)
        results.append(staging.read_on_device(
            {"x": hosts[-1]}, lambda x: (x.device, x.data_ptr() == staging._mine()[0]["x"].data_ptr(), x + 0)))
    for host, (device_seen, in_place, values) in zip(hosts, results):
        assert device_seen.type == "cuda" and in_place
        assert torch.equal(values.cpu(), host + 0)
    assert staging.mapped, "pinned buffers were not readable in place on this device"


@pytest.mark.gpu
def test_device_alias_refuses_pageable_memory():
    with pytest.raises(ValueError, match="pinned"):
        device_alias(torch.zeros(4), torch.device("cuda"))


@pytest.mark.gpu
def test_a_roles_views_read_through_its_buffers_alias_made_again_when_the_buffer_grows():
    """Views of one role, smaller and then larger than its buffer, are read in place with the right values; the
    alias follows the buffer the role holds now."""
    staging = StagingBuffers(torch.device("cuda", torch.cuda.current_device()))
    for shape, dtype in [((8, 4), torch.float32), ((2, 3), torch.bfloat16), ((64, 64), torch.float32)]:
        host = torch.randn(shape).to(dtype)
        got = staging.read_on_device({"x": host}, lambda x: (x.data_ptr(), (x + 0).cpu()))
        buffer = staging._mine()[0]["x"]
        assert got[0] == buffer.data_ptr() and torch.equal(got[1], host)
        assert staging._local.aliases["x"][0] is buffer
