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
* ``runner``     — admission (per data-parallel rank) and stepping through the public engine API
* ``measure`` / ``scoring`` / ``records`` / ``aggregate`` / ``report`` — timings, scores, JSONL records,
  results, table + JSON + CSV + plots
* ``benchmark``  — one resumable ``mode=run``; ``catalog`` — ``mode=catalog``; ``app`` — the mode bodies

``prepare``, ``validate`` and ``catalog`` never import torch or the engine.
"""
