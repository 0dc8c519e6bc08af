"""A Hydra app on RedKnot's real ``conf/`` whose run body only records what it was given.

It drives the real path (compose -> resolve -> open_tracker -> sweep callback) end to
end in a subprocess without the benchmark harness:
``python tests/unit/tracking/tracked_app.py output.root=/tmp/x [-m seed=1,2 ...]``.
"""
import sys
from pathlib import Path

import hydra

import redknot
from redknot.__main__ import exit_code, run_job
from redknot.config.modes import ModeBody
from redknot.config.schema import Mode

CONF_DIR = str(Path(redknot.__file__).resolve().parents[1] / "conf")


def record(ctx, tracker) -> int:
    cfg = ctx.cfg
    tracker.log_metrics({"job.seed": cfg.seed, "job.samples": cfg.suite.samples_per_dataset})
    (ctx.run_dir / "body.txt").write_text(f"seed={cfg.seed}\n")
    if cfg.seed == 98:
        raise RuntimeError("seed=98 plays a crashing job")
    if cfg.seed == 97:  # plays a full disk under the records file
        import errno

        raise OSError(errno.ENOSPC, "No space left on device", str(ctx.run_dir / "records.jsonl"))
    return int(cfg.seed == 99)  # seed=99 plays a job that reports failure


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg) -> None:
    run_job(cfg, body=ModeBody(Mode.run, record, tracked=True))


if __name__ == "__main__":
    main()
    sys.exit(exit_code())
