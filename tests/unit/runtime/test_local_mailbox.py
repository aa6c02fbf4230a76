"""wire/local.py: a message between two stages of one rank arrives as a message would, and order bugs raise."""
from __future__ import annotations

import pytest
import torch

from model_parallel.errors import ModelParallelError
from model_parallel.runtime.wire.local import LocalRecv, Mailbox


def test_a_message_arrives_as_fresh_leaves_with_the_senders_requires_grad() -> None:
    box = Mailbox(rank=3)
    sent = torch.ones(2, requires_grad=True) * 2.0  # not a leaf: part of the sender's graph
    ids = torch.tensor([1, 2])
    box.put(17, 0, [sent, ids, None, "text"], structure={"list": []})
    recv = LocalRecv(box, 17, 0)
    got = recv.wait(timeout=1.0)
    assert recv.structure == {"list": []}
    assert got[0].is_leaf and got[0].requires_grad and got[0].grad_fn is None
    assert got[0].data_ptr() != sent.data_ptr()  # a copy: the receiver cannot write into the sender's tensor
    assert torch.equal(got[0], sent) and torch.equal(got[1], ids) and not got[1].requires_grad
    assert got[2:] == [None, "text"]


def test_order_bugs_raise_at_once_naming_the_message() -> None:
    box = Mailbox(rank=1)
    with pytest.raises(ModelParallelError, match=r"rank 1: no message under tag 16, stream 4"):
        LocalRecv(box, 16, 4).wait(timeout=1.0)
    box.put(16, 4, [torch.zeros(1)])
    with pytest.raises(ModelParallelError, match="a second message under tag 16, stream 4"):
        box.put(16, 4, [torch.zeros(1)])


def test_under_bf16_a_float32_value_arrives_rounded_as_the_wire_rounds_it() -> None:
    box = Mailbox(rank=0, wire_dtype=torch.bfloat16)
    sent = torch.tensor([1.0 + 2.0 ** -10, 3.0], requires_grad=True) * 1.0  # 1 + 2^-10: not a bf16 value
    half = torch.tensor([1.5], dtype=torch.bfloat16)
    box.put(16, 0, [sent, half])
    got, _ = box.take(16, 0)
    assert got[0].dtype == torch.float32 and got[0].is_leaf and got[0].requires_grad
    assert torch.equal(got[0], sent.detach().to(torch.bfloat16).float()) and not torch.equal(got[0], sent)
    assert got[1].dtype == torch.bfloat16 and torch.equal(got[1], half)  # no wider than the wire: as it is
