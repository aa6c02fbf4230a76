"""The packed message buffer (runtime/wire): `_pack` lays every tensor at its header's offset, narrowed to the wire dtype,
and `read_prefix` reads the 8-byte prefix; both against the layout computed the slow way."""
from __future__ import annotations

import json

import pytest
import torch

from model_parallel.runtime.wire import comm
from model_parallel.runtime.wire.packed import known_header, read_prefix, unpack, write_prefix
from model_parallel.runtime.wire.structure import make_header

CASES = {
    "one activation": [torch.randn(2, 16)],
    "mixed, padded, empty, transposed": [torch.randn(3, 5), torch.arange(7), torch.randn(4, 4).t(), torch.ones(0),
                                         torch.tensor(True), 3],
    "float64": [torch.randn(5, 3, dtype=torch.float64)],
}


@pytest.mark.parametrize("wire", [None, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_pack_puts_each_tensor_at_its_offset_in_the_wire_dtype(case: str, wire: torch.dtype) -> None:
    values = CASES[case]
    header = make_header(values, None, wire)
    known = known_header(json.dumps(header).encode(), header)
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    buffer = comm._pack(tensors, known, torch.device("cpu"))
    assert buffer.dtype == torch.uint8 and buffer.numel() == known.size
    assert read_prefix(buffer) == 0  # "same header as last time"
    for tensor, (offset, shape, dtype, nbytes, stride) in zip(tensors, known.tensors):
        # A dense layout travels in its own order (the transpose: its storage, i.e. the tensor it transposes).
        laid = tensor.t().contiguous() if stride is not None else tensor.contiguous()
        assert stride == (tuple(tensor.stride()) if tensor.dim() == 2 and not tensor.is_contiguous() else None)
        expected = laid.to(dtype).reshape(-1).view(torch.uint8)
        assert torch.equal(buffer[offset:offset + nbytes], expected)
    out = unpack(buffer, known, torch.device("cpu"))
    for value, got in zip(values, out):
        if isinstance(value, torch.Tensor):
            assert got.shape == value.shape and got.stride() == value.stride() and torch.equal(got, value.to(got.dtype) if wire is None or not value.is_floating_point()
                                                            else value.to(wire).to(got.dtype))
        else:
            assert got == value


@pytest.mark.parametrize("value", [0, 1, 1016, 2 ** 40 + 5])
def test_read_prefix_reads_what_write_prefix_wrote(value: int) -> None:
    buffer = torch.zeros(48, dtype=torch.uint8)
    write_prefix(buffer[16:], value)
    assert read_prefix(buffer[16:]) == value  # a view at an offset: data_ptr counts it
    assert read_prefix(buffer) == 0
