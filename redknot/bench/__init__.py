"""The RedKnot benchmark harness: long-context suites, frozen exact-length inputs, scoring, reports.

One module per role:

* ``registry``   — datasets: LongBench templates, metrics, generation lengths; synthetic task names
* ``datasets``   — LongBench JSONL from a directory, ``data.zip`` (sha256-pinned) or the packaged sample
* ``synthetic``  — RULER-style tasks (needles, multi-key, multi-value, variable tracking) from a seed
* ``fixtures``   — LongBench-format data made by RedKnot (tests, the smoke sample, scale runs)
* ``casebuild``  — one prompt of exactly the target length, joined from token ids
* ``suite``      — every case of a suite (+ manifest entries); ``tokenizer`` / ``tokcache`` feed it
* ``store`` / ``freeze`` — the content-addressed frozen-input store and ``mode=prepare``
* ``validate``   — re-derive inputs bit for bit; check a results directory against its manifest
* ``integrity``  — hash checks of a frozen-input entry on every reuse; ``release`` — release suites and
  ``RELEASE_SUITES.json``; ``preflight`` — everything done before an engine starts
* ``runner``     — admission (per data-parallel rank) and stepping through the public engine API;
  ``cases`` — one case at a time: hot-TTFT repetitions, the scored run, its record
* ``measure`` / ``scoring`` / ``records`` / ``aggregate`` / ``report`` — timings, scores, JSONL records,
  results, table + JSON + CSV + plots; ``notes`` — what the numbers mean; ``runlog`` — ``report.md``
* ``benchmark``  — one resumable ``mode=run``; ``compare`` / ``comparison`` — ``mode=compare`` and its
  pages; ``catalog`` — ``mode=catalog``; ``app`` — the mode bodies

``prepare``, ``validate`` and ``catalog`` never import torch or the engine.
"""
