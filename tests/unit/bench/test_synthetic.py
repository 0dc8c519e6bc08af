"""Synthetic tasks: the needles sit in the prompt, in order, and the references are what they state."""
import re

from redknot.bench import synthetic
from redknot.bench.datasets import SourceReader
from redknot.bench.suite import SuiteBuilder
from redknot.bench.scoring import contains_all
from redknot.config.schema import DataConfig, SuiteConfig


def test_rows_are_deterministic_and_answers_follow_from_needles():
    for task in synthetic.TASKS:
        first = synthetic.generate_rows(task, 5, seed=7)
        assert first == synthetic.generate_rows(task, 5, seed=7)
        assert first != synthetic.generate_rows(task, 5, seed=8)
        for row in first:
            stated = " ".join(row.needles)
            assert all(answer in stated for answer in row.answers), (task, row)
            assert list(row.depths) == sorted(row.depths)
    vt = synthetic.generate_rows("variable_tracking", 1, seed=0)[0]
    value = re.search(r"= (\d+)\.", vt.needles[0]).group(1)
    assert value in vt.question and [n.split()[1] for n in vt.needles] == list(vt.answers)


def test_needles_are_in_the_prompt_in_order(tokenizer):
    suite = SuiteConfig(context_tokens=3000, datasets=["niah_multikey", "variable_tracking"], samples_per_dataset=3,
                        data=DataConfig())
    builder = SuiteBuilder(suite, tokenizer, SourceReader(suite.data))
    rows = {(t, r.index): r for t in ("niah_multikey", "variable_tracking")
            for r in synthetic.generate_rows(t, 3, suite.seed)}
    for entry, ids in builder.build():
        row = rows[(entry.dataset, entry.row_index)]
        texts = [tokenizer.decode(ids[s:e]).strip() for s, e in entry.gold_spans]
        assert texts == list(row.needles)
        prompt = tokenizer.decode(ids)
        assert prompt.startswith("<｜begin▁of▁sentence｜><｜User｜>") and prompt.endswith("<｜Assistant｜></think>")
        assert row.question in prompt and len(ids) == 3000
        assert contains_all(" ".join(row.answers), list(entry.answers)) == 1.0
