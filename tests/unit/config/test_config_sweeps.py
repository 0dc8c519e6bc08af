"""Committed sweep specs (+sweep=NAME) and launcher presets compose; every job of a sweep validates."""
import importlib.util
import itertools

import pytest
from hydra import compose
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode

from config_testutil import hydra_context
from redknot.config.hardware_fit import CONF_DIR

SWEEPS = sorted(p.stem for p in (CONF_DIR / "sweep").glob("*.yaml"))


def test_at_least_two_sweeps_are_committed():
    assert {"dspark_draft", "context_scaling"} <= set(SWEEPS)


@pytest.mark.parametrize("name", SWEEPS)
def test_sweep_is_a_multirun_whose_every_job_validates(resolved, name):
    with hydra_context():
        cfg = compose("config", overrides=[f"+sweep={name}"], return_hydra_config=True)
    assert cfg.hydra.mode == RunMode.MULTIRUN
    params = dict(cfg.hydra.sweeper.params)
    assert params, f"sweep {name} sweeps nothing"
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    axes = [[f"{o.key_or_group}={v}" for v in o.sweep_string_iterator()] for o in parsed]
    jobs = list(itertools.product(*axes))
    assert len(jobs) >= 2
    for job in jobs:
        resolved(f"+sweep={name}", *job)  # raises ConfigError if a job's config is invalid


def test_dspark_sweep_values():
    with hydra_context():
        cfg = compose("config", overrides=["+sweep=dspark_draft"], return_hydra_config=True)
    assert cfg.hydra.sweeper.params["features.dspark.max_draft"] == "0,1,3,5"


def test_slurm_launcher_preset_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    with hydra_context():
        cfg = compose("config", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher") and launcher.gpus_per_node == 1
    assert launcher.submitit_folder.startswith("outputs/multirun/")  # job files stay under outputs/


@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is None,
                    reason="hydra-ray-launcher (extra 'ray') is not installed")
def test_ray_launcher_preset_composes():
    with hydra_context():
        cfg = compose("config", overrides=["hydra/launcher=ray_cluster"], return_hydra_config=True)
    assert cfg.hydra.launcher.ray.remote.num_gpus == 1
