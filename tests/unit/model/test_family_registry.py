"""The model-family registry (which family serves a config or a checkpoint) and V4's family."""
import json

import pytest
import torch

from redknot.config.schema import HardwareConfig, ModelConfig, SyntheticModelConfig
from redknot.models import registry
from redknot.models.deepseek_v4.config import V4Config, flash_config_dict
from redknot.models.deepseek_v4.cost import CostModel
from redknot.models.deepseek_v4.state_layout import StateLayout
from redknot.models.deepseek_v4.synthetic import TINY_ARCHITECTURE
from redknot.models.family import MTP, ModelFamily
from redknot.models.registry import FamilyEntry, FamilyError, detect_family, family_for, load_family

OTHER = FamilyEntry("other", ("OtherForCausalLM",), ("other",), "redknot.models.deepseek_v4.family")


def checkpoint_dir(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_every_registered_family_loads_and_names_itself():
    for entry in registry.list_families():
        family = load_family(entry.name)
        assert isinstance(family, ModelFamily) and family.entry == entry and family.name == entry.name


def test_a_checkpoint_is_recognised_by_architectures_and_model_type():
    assert detect_family(flash_config_dict()).name == "deepseek_v4"
    assert detect_family({"model_type": "deepseek_v4"}).name == "deepseek_v4"
    assert detect_family({"architectures": ["DeepseekV4ForCausalLM"]}).name == "deepseek_v4"
    with pytest.raises(FamilyError) as err:
        detect_family({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    assert ("architectures=['LlamaForCausalLM'], model_type='llama': no registered model family loads it "
            "(accepted: deepseek_v4: architectures ['DeepseekV4ForCausalLM'], model_type ['deepseek_v4']; "
            "deepseek_v41: architectures ['DeepseekV41ForCausalLM'], model_type ['deepseek_v41', "
            "'deepseek_v41_text'])") in str(err.value)
    with pytest.raises(FamilyError):  # every field it states must match
        detect_family({"architectures": ["DeepseekV4ForCausalLM"], "model_type": "llama"})


def test_unknown_model_family_names_the_known_ones():
    with pytest.raises(FamilyError, match=r"model.family='llama': not a registered model family; known families: "
                                          r"\['deepseek_v4', 'deepseek_v41'\]"):
        family_for(ModelConfig(family="llama"))


def test_model_family_must_agree_with_the_checkpoint(tmp_path, monkeypatch):
    path = checkpoint_dir(tmp_path, {"architectures": ["OtherForCausalLM"], "model_type": "other"})
    monkeypatch.setattr(registry, "FAMILIES", registry.FAMILIES + (OTHER,))
    with pytest.raises(FamilyError) as err:
        family_for(ModelConfig(family="deepseek_v4", path=path))
    assert str(err.value) == (
        f"model.family='deepseek_v4' but {path}/config.json declares architectures=['OtherForCausalLM'], "
        f"model_type='other', which is model family 'other'; set model.family=other")


def test_model_family_is_taken_when_the_checkpoint_agrees_or_states_nothing(tmp_path):
    v4 = checkpoint_dir(tmp_path, flash_config_dict())
    assert family_for(ModelConfig(family="deepseek_v4", path=v4)) is load_family("deepseek_v4")
    assert family_for(ModelConfig(family="deepseek_v4")).name == "deepseek_v4"  # synthetic: no config.json yet


def test_v4_config_parser_and_layout_and_cost_go_through_the_family(tmp_path):
    family = load_family("deepseek_v4")
    d = flash_config_dict()
    cfg = family.parse_config(d)
    assert cfg == V4Config.from_hf_dict(d) == family.parse_config(checkpoint_dir(tmp_path, d))
    layout = family.state_layout(cfg, block_size=256, max_backtrack=5, kv_bytes=2)
    assert layout == StateLayout.create(cfg, block_size=256, max_backtrack=5, kv_bytes=2)
    assert family.cost_model(cfg).prefill(4096) == CostModel(cfg).prefill(4096)
    assert family.load_tokenizer(None).eos_id == cfg.eos_token_id


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache"))
    model_cfg = ModelConfig(name="tiny", synthetic=SyntheticModelConfig(seed=0, architecture=dict(TINY_ARCHITECTURE)))
    family = family_for(model_cfg)
    return family, model_cfg, cache, family.build_model(model_cfg, HardwareConfig(), cache)


def test_v4_family_builds_the_synthetic_model_with_its_state_and_drafter(tiny):
    family, model_cfg, cache, model = tiny
    path = family.write_synthetic_checkpoint(model_cfg, cache)  # already written by the build: same directory
    assert family.parse_config(path) == model.cfg
    layout = family.state_layout(model.cfg, block_size=128, max_backtrack=2, kv_bytes=4)
    state = family.allocate_state(model.cfg, layout, num_slots=2, num_blocks=3, device="cpu", dtype=torch.float32)
    assert state.layout is layout and state.num_slots == 2 and state.num_blocks == 3
    assert family.draft_models(model) == {MTP: model}
    assert len(family.expert_layers(model)) == model.cfg.num_layers
    hooks = family.context_parallel()
    assert callable(hooks.attention) and callable(hooks.idle)

