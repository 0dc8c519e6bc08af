"""Everything ``mode=run`` and ``mode=compare`` do before an engine starts.

The suite's frozen inputs are built or reused (checked by hashes; a damaged entry is rebuilt,
or refused for a release suite, whose files must stay as frozen), a release suite is checked
against ``RELEASE_SUITES.json``, and every case's prompt ids are read. A problem with the
inputs therefore stops the run with the file named before any device work, never halfway.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from rich.console import Console

from redknot.bench.freeze import FreezeResult, freeze
from redknot.bench.integrity import InputsError
from redknot.bench.runner import CaseJob
from redknot.bench.frozen_inputs import FrozenInputs


@dataclass
class Prepared:
    """Frozen inputs ready to run: the freeze result, every case's job, the release manifest if any."""
    frozen: FreezeResult
    jobs: List[CaseJob]
    release_manifest: Optional[Path] = None

    @property
    def inputs(self) -> FrozenInputs:
        return self.frozen.inputs


def load_jobs(inputs: FrozenInputs) -> List[CaseJob]:
    jobs = []
    for case in inputs.cases:
        try:
            ids = inputs.load_ids(case)
        except (OSError, ValueError) as err:
            raise InputsError(f"{inputs.ids_path(case)}: cannot read the prompt ids of case {case.case_id} "
                              f"({err}); rerun mode=prepare to rebuild the inputs") from None
        jobs.append(CaseJob(case, ids.tolist()))
    return jobs


def prepare_run(cfg, console: Console) -> Prepared:
    """Freeze (or check and reuse) the inputs of ``cfg.suite``; see the module docstring."""
    suite = cfg.suite
    frozen = freeze(suite, cfg.model, Path(cfg.output.cache_dir), console=console, repair=not suite.release)
    inputs = frozen.inputs
    verb = "rebuilt" if frozen.repaired else ("reused" if frozen.reused else "built")
    console.print(f"inputs {inputs.address}: {len(inputs.cases)} cases of {suite.context_tokens} tokens "
                  f"({verb} in {frozen.seconds:.1f} s)")
    release = None
    if suite.release:
        from redknot.bench.release import check_release

        release = check_release(Path(cfg.output.cache_dir), suite, inputs)
        console.print(f"release suite {suite.name}: files, order and execution contract match {release}")
    return Prepared(frozen, load_jobs(inputs), release)
