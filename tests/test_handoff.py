"""Handoff wire format and stream protocol, without Ray: bf16 stays 2 bytes a value, unwanted payloads never leave."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from omni_serve import payload as handoff
from omni_serve.graph.transport import PAYLOAD_FOLLOWS, stream_items
from omni_serve.payload import HandoffPayload
from omni_serve.types import StageOutput


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float16, torch.float32, torch.int64])
def test_tensors_cross_the_wire_bit_exact_at_their_own_width(dtype: torch.dtype) -> None:
    original = (torch.randn(5, 7) * 3).to(dtype)
    arrays, dtypes = handoff.arrays({"x": original})
    assert arrays["x"].nbytes == original.numel() * original.element_size()  # never widened
    payload = HandoffPayload("test", arrays, {"dtypes": dtypes})
    received = pickle.loads(pickle.dumps(payload, protocol=5))  # what the object store does
    for array in received.tensors.values():
        array.flags.writeable = False  # as arrays come out of the object store
    back = handoff.tensor(received, "x")
    assert back.dtype == dtype and back.shape == original.shape
    assert torch.equal(back.view(torch.uint8), original.view(torch.uint8))  # bit for bit (NaNs included)


def test_numpy_arrays_pass_unchanged_and_tensors_land_on_the_device() -> None:
    ids = np.arange(4, dtype=np.int64)
    arrays, dtypes = handoff.arrays({"ids": ids})
    assert arrays["ids"] is ids and dtypes == {}
    assert handoff.tensor(HandoffPayload("test", arrays), "ids", "cpu").tolist() == [0, 1, 2, 3]


def test_detached_payload_owns_writable_copies() -> None:
    stored = np.ones(8, dtype=np.float32)
    stored.flags.writeable = False  # a zero-copy view into the object store
    payload = HandoffPayload("test", {"x": stored}, {"dtypes": {}})
    copy = handoff.detached(payload)
    assert copy.kind == "test" and copy.meta == payload.meta
    assert copy.tensors["x"].flags.writeable and not np.shares_memory(copy.tensors["x"], stored)
    np.testing.assert_array_equal(copy.tensors["x"], stored)


def test_a_wanted_payload_follows_its_output_as_its_own_stream_item() -> None:
    payload = HandoffPayload("test", {"x": np.zeros(3)})
    output, item = stream_items(StageOutput(stage="s", handoff=payload, finished=True), wanted=True)
    assert item is payload and output.finished
    assert pickle.loads(pickle.dumps(output)).handoff is PAYLOAD_FOLLOWS  # the marker survives the wire


def test_an_unwanted_payload_is_never_sent() -> None:
    payload = HandoffPayload("test", {"x": np.zeros(3)})
    items = stream_items(StageOutput(stage="s", text="hi", handoff=payload), wanted=False)
    assert len(items) == 1 and items[0].handoff is None and items[0].text == "hi"
    (plain,) = stream_items(StageOutput(stage="s", text="hi"), wanted=True)
    assert plain.handoff is None


def test_padding_is_a_tensor_no_engine_reads() -> None:
    payload = handoff.padded(HandoffPayload("test", {"codes": np.zeros((2, 3), np.int64)}), 1 << 20)
    assert payload.tensors["padding"].nbytes == 1 << 20 and payload.tensors["codes"].shape == (2, 3)
    assert "padding" not in handoff.padded(HandoffPayload("test", {}), 0).tensors


def test_a_stage_pads_the_payloads_it_yields_when_its_graph_says_so() -> None:
    payload = HandoffPayload("test", {"codes": np.zeros((2, 3), np.int64)})
    _, item = stream_items(StageOutput(stage="s", handoff=payload), wanted=True, padding_bytes=4096)
    assert item.tensors["padding"].nbytes == 4096 and item.tensors["codes"].shape == (2, 3)
