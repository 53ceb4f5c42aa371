"""The graphed decode step's input buffers (engine/static_inputs.py): a batch's rows copied in, padding rows on
the KV cache's scratch slot, whichever way the batch was built."""

from __future__ import annotations

import torch

from moerun.engine.batch import ForwardBatch
from moerun.engine.kv_cache import KVCache
from moerun.engine.static_inputs import StaticInputs


def make_inputs(n: int = 8) -> StaticInputs:
    cache = KVCache(num_layers=1, num_slots=6, max_len=32, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                    device=torch.device("cpu"))  # fmt: skip
    return StaticInputs(n, cache)


def test_fill_copies_the_batch_and_pads_to_the_bucket() -> None:
    inputs = make_inputs()
    pad = inputs.cache.pad_slot
    # rows left from an earlier, larger batch must be overwritten by the padding
    inputs.fill(torch.arange(8), ForwardBatch.build([9] * 8, [1] * 8, [0, 1, 2, 3, 4, 5, 0, 1], torch.device("cpu")),
                8)  # fmt: skip
    batch = ForwardBatch.build([5, 11, 3], [1, 1, 1], [4, 0, 2], torch.device("cpu"))
    inputs.fill(torch.tensor([7, 8, 9]), batch, 4)
    assert inputs.input_ids[:4].tolist() == [7, 8, 9, 0]
    assert inputs.positions[:4].tolist() == [5, 11, 3, 0]
    assert inputs.token_slots[:4].tolist() == [4, 0, 2, pad]
    assert inputs.slot_ids[:4].tolist() == [4, 0, 2, pad]
    assert inputs.seq_lens[:4].tolist() == [6, 12, 4, 1]
    graphed = inputs.batch(4)  # what the captured step reads
    assert graphed.positions.data_ptr() == inputs.positions.data_ptr()
    assert graphed.token_slots[:3].tolist() == [4, 0, 2]


def test_fill_takes_a_batch_made_field_by_field() -> None:
    inputs = make_inputs()
    built = ForwardBatch.build([2, 6], [1, 1], [1, 3], torch.device("cpu"))
    other = make_inputs()
    fields = {k: getattr(built, k).clone() for k in ("positions", "token_slots", "slot_ids", "seq_lens", "last_rows")}
    loose = ForwardBatch(is_prefill=False, **fields, slots=[1, 3], query_lens=[1, 1], start_positions=[2, 6],
                         max_seq_len=7)  # fmt: skip
    inputs.fill(torch.tensor([1, 2]), built, 2)
    other.fill(torch.tensor([1, 2]), loose, 2)
    assert torch.equal(inputs.meta, other.meta) and torch.equal(inputs.input_ids, other.input_ids)
