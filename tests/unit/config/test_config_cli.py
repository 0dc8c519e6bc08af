"""`python -m redknot` itself, in a subprocess on this CPU-only machine."""
import os
import subprocess
import sys

from redknot.config import golden
from redknot.config.hardware_fit import CONF_DIR

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
    assert "DEEPINFER_USE_NEXTN_DECODE=0  ->  features.dspark.method=none" in stopped.stderr
    assert f"python -m redknot mode=catalog output.root={tmp_path} features.dspark.method=none" in stopped.stderr
    assert stopped.stdout == ""


def test_config_error_exits_2_with_every_violation(tmp_path):
    out = run_cli("mode=catalog", f"output.root={tmp_path}", "features.deterministic=true", cwd=tmp_path)
    assert out.returncode == 2
    assert "invalid configuration (2 problems)" in out.stderr


def test_group_options_are_the_conf_files():
    from redknot.config.group_options import group_options

    options = group_options()
    for group in ("model", "hardware", "features", "suite", "sweep", "compare"):
        assert options[group] == sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    assert {"basic", "slurm", "ray_cluster"} <= set(options["hydra/launcher"])


def test_catalog_without_harness_details_summarises_each_option(capsys):
    from types import SimpleNamespace

    from redknot.config.group_options import catalog_with

    assert catalog_with(None)(SimpleNamespace(choices={"hardware": "sm100"})) == 0
    out = capsys.readouterr().out
    assert "* sm100" in out and "[planned] Blackwell B200/GB200" in out
    assert "450560 tokens x 10 per dataset" in out
    assert "hardware options that fit: cpu" in out  # this CPU-only machine


def test_every_composition_problem_is_reported_at_once_with_exit_2(tmp_path):
    out = run_cli("suite=nope", "features.swa_replay.mode=full", "suite.context_tokens=lots",
                  "engine.scheduler.block_size=257", cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert "invalid configuration (4 problems)" in out.stderr  # three overrides, and a rule the rest break
    assert "suite=nope: In 'config': Could not find 'suite/nope'" in out.stderr and "smoke" in out.stderr
    assert "features.swa_replay.mode=full: Invalid value 'full', expected one of [off, compact]" in out.stderr
    assert "suite.context_tokens=lots" in out.stderr and "Traceback" not in out.stderr
    # the overrides that compose are still checked against the rules, in the same message
    rules = run_cli("model=tiny", "engine.scheduler.block_size=257", "features.deterministic=true", cwd=tmp_path)
    assert rules.returncode == 2 and "invalid configuration (3 problems)" in rules.stderr
    assert "engine.scheduler.block_size=257: must be a multiple of every compress ratio [4, 128]" in rules.stderr
    sweep = run_cli("-m", "mode=catalog", "suite=smoke,nope", cwd=tmp_path)
    assert sweep.returncode == 2 and "suite=smoke,nope: suite=nope: In 'config'" in sweep.stderr
    assert not list(tmp_path.iterdir())  # nothing was written


def test_output_paths_outside_the_start_directory_need_a_flag(tmp_path):
    out = run_cli("output.root=/", cwd=tmp_path)
    assert out.returncode == 2 and "output.root=/: lies outside the directory the run starts from" in out.stderr
    assert "output.allow_outside_cwd=true" in out.stderr
    target = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    hydra_dir = run_cli("mode=catalog", f"hydra.run.dir={target}", "tracking.enabled=false", cwd=tmp_path)
    assert hydra_dir.returncode == 2 and f"hydra.run.dir={target}: lies outside" in hydra_dir.stderr
    assert not target.exists()
    allowed = run_cli("mode=catalog", f"hydra.run.dir={target}", "output.allow_outside_cwd=true",
                      "tracking.enabled=false", cwd=tmp_path)
    assert allowed.returncode == 0 and target.is_dir()
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    unwritable = run_cli("mode=catalog", f"output.root={blocked}/out", cwd=tmp_path)
    assert unwritable.returncode == 2 and f"cannot be created: {blocked} is a file" in unwritable.stderr


def test_cfg_job_applies_or_refuses_legacy_variables(tmp_path):
    legacy = {"DEEPINFER_USE_NEXTN_DECODE": "0"}
    stopped = run_cli("--cfg", "job", env=legacy, cwd=tmp_path)
    assert stopped.returncode == 2 and stopped.stdout == ""
    assert "DEEPINFER_USE_NEXTN_DECODE=0  ->  features.dspark.method=none" in stopped.stderr
    translated = run_cli("legacy_env=translate", "--cfg", "job", env=legacy, cwd=tmp_path)
    assert translated.returncode == 0
    dspark = translated.stdout.split("dspark:", 1)[1].split("\n")[1]
    assert dspark.strip() == "method: none"
