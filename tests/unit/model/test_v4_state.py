"""State layout numbers, allocation and step metadata."""
import subprocess
import sys

import pytest
import torch

from redknot.models.deepseek_v4.config import V4Config
from redknot.models.deepseek_v4.state_layout import StateLayout
from redknot.step.metadata import StepMetadata
from redknot.models.deepseek_v4.state import V4State
from v4_testutil import PARITY_CONFIG

CFG = V4Config.from_hf_dict(PARITY_CONFIG)  # SWA, CSA (m=4), HCA (m=8), CSA + MTP


def test_layout_sizes_and_allocation_agree():
    layout = StateLayout.create(CFG, block_size=16, max_backtrack=3, kv_bytes=4)
    assert (layout.swa_ring, layout.csa_ring, layout.hca_ring) == (8 + 3, 2 * 4 + 3, 8 + 3)
    assert (layout.csa_entries_per_block, layout.hca_entries_per_block) == (4, 2)
    state = V4State.allocate(CFG, layout, num_slots=3, num_blocks=5)
    assert state.nbytes() == 3 * layout.bytes_per_slot + 5 * layout.bytes_per_block
    assert len(state.mtp) == 1 and state.layers[0].entries is None and state.layers[1].idx_keys.shape == (5, 4, 32)
    assert state.layers[2].kv_rows.shape == (3, 11, 64) and state.layers[1].kv_rows.shape == (3, 11, 128)
    assert layout.blocks_for(33) == 3


def test_layout_and_allocation_errors_name_the_setting():
    with pytest.raises(ValueError, match="engine.scheduler.block_size=12"):
        StateLayout.create(CFG, block_size=12)
    layout = StateLayout.create(CFG, block_size=8, kv_bytes=2)
    with pytest.raises(ValueError, match="kv_bytes=2"):
        V4State.allocate(CFG, layout, 1, 1, dtype=torch.float32)


def test_step_metadata_build():
    meta = StepMetadata.build([[5, 6, 7], [8]], context_lens=[0, 10], seq_slots=[2, 0], block_tables=[[1], [0, 3]])
    assert meta.positions.tolist() == [0, 1, 2, 10]
    assert meta.query_start_loc.tolist() == [0, 3, 4] and meta.logits_indices.tolist() == [2, 3]
    assert meta.block_tables.tolist() == [[1, 0], [0, 3]] and meta.seq_slot_list == [2, 0]
    with pytest.raises(ValueError, match="at least one new token"):
        StepMetadata.build([[1], []], [0, 0], [0, 1], [[0], [1]])
    with pytest.raises(ValueError, match="num_tokens_per_seq"):
        StepMetadata(input_ids=torch.zeros(3, dtype=torch.long), positions=torch.zeros(3, dtype=torch.long),
                     query_start_loc=torch.tensor([0, 2]), seq_slots=torch.tensor([0]),
                     block_tables=torch.zeros(1, 1, dtype=torch.int32), logits_indices=torch.tensor([1]),
                     num_tokens_per_seq=[2], context_lens=[0])


def test_layout_is_importable_without_torch():
    code = ("import sys; from redknot.models.deepseek_v4 import StateLayout, V4Config; "
            "StateLayout.create(V4Config.flash()); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
