"""The multi-GPU Slurm launcher preset composes, and a Slurm task's variables become torchrun's."""
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import redknot.config.schema_store  # noqa: F401  (the schema in Hydra's ConfigStore)
from redknot.config.hardware_fit import CONF_DIR
from redknot.parallel.layout import LaunchEnv


def test_slurm_multigpu_preset_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm_multigpu", "features.parallel.dp=8",
                                           "features.parallel.ep=8"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.tasks_per_node == launcher.gpus_per_node == 8  # one rank per GPU
    assert launcher.nodes * launcher.tasks_per_node == cfg.features.parallel.dp * cfg.features.parallel.cp
    assert launcher.submitit_folder.startswith("outputs/multirun/")


def test_slurm_task_variables_become_torchrun_variables(monkeypatch):
    pytest.importorskip("submitit")
    from redknot.parallel.layout import export_slurm_env

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # recorded, so the variables the export writes are removed afterwards
        monkeypatch.delenv(key)
    slurm = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "16", "SLURM_PROCID": "11",
             "SLURM_LOCALID": "3",
             "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]",
             "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_NNODES": "2"}
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    assert export_slurm_env()
    import os

    assert LaunchEnv.from_env() == LaunchEnv(rank=11, world_size=16, local_rank=3, local_world_size=8)
    assert os.environ["MASTER_ADDR"] == "gpu07" and int(os.environ["MASTER_PORT"]) > 0
    assert not export_slurm_env()  # RANK is set now: torchrun's variables win


def test_export_leaves_the_environment_clean():
    import os

    assert "RANK" not in os.environ and "MASTER_ADDR" not in os.environ
