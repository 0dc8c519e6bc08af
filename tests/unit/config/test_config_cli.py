"""`python -m redknot` itself, in a subprocess on this CPU-only machine."""
import os
import subprocess
import sys

from redknot.config import golden
from redknot.config.device import CONF_DIR

REPO = CONF_DIR.parent


def run_cli(*args, env=None, cwd=None):
    base = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    return subprocess.run([sys.executable, "-m", "redknot", *args], capture_output=True, text=True,
                          cwd=cwd or REPO, env={**base, **(env or {})}, timeout=120)


def test_cfg_job_resolve_prints_the_composed_config_on_cpu():
    out = run_cli("suite=128k", "hardware=sm100", "features.dspark.max_draft=5", "--cfg", "job", "--resolve")
    assert out.returncode == 0, out.stderr
    snapshot = (golden.GOLDEN_DIR / "128k__sm100.yaml").read_text()
    assert out.stdout == snapshot.split("\n", 2)[2]  # the snapshot minus its two header lines
    assert "sparse_attention: flash_mla" in out.stdout


def test_catalog_lists_every_group_option_and_legacy_stop(tmp_path):
    out = run_cli("mode=catalog", f"output.root={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for group in ("model", "hardware", "features", "suite", "sweep"):
        for path in (CONF_DIR / group).glob("*.yaml"):
            assert path.stem in out.stdout, (group, path.stem)
    # The run directory is under output.root with a microsecond timestamp, and nothing else was written.
    run_dirs = list(tmp_path.glob("*/*"))
    assert len(run_dirs) == 1 and len(run_dirs[0].name) == len("10-28-14-464400")

    stopped = run_cli("mode=catalog", f"output.root={tmp_path}", env={"DEEPINFER_USE_NEXTN_DECODE": "0"},
                      cwd=tmp_path)
    assert stopped.returncode == 2
    assert "DEEPINFER_USE_NEXTN_DECODE=0  ->  features.dspark.enabled=false" in stopped.stderr
    assert f"python -m redknot mode=catalog output.root={tmp_path} features.dspark.enabled=false" in stopped.stderr
    assert stopped.stdout == ""


def test_config_error_exits_2_with_every_violation(tmp_path):
    out = run_cli("mode=catalog", f"output.root={tmp_path}", "features.deterministic=true", cwd=tmp_path)
    assert out.returncode == 2
    assert "invalid configuration (2 problems)" in out.stderr


def test_group_options_are_the_conf_files():
    from redknot.config.catalog import group_options

    options = group_options()
    for group in ("model", "hardware", "features", "suite", "sweep", "compare"):
        assert options[group] == sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    assert {"basic", "slurm", "ray_cluster"} <= set(options["hydra/launcher"])


def test_catalog_without_harness_details_summarises_each_option(capsys):
    from types import SimpleNamespace

    from redknot.config.catalog import catalog_with

    assert catalog_with(None)(SimpleNamespace(choices={"hardware": "sm100"})) == 0
    out = capsys.readouterr().out
    assert "* sm100" in out and "[planned] Blackwell B200/GB200" in out
    assert "450560 tokens x 10 per dataset" in out
    assert "hardware options that fit: cpu" in out  # this CPU-only machine
