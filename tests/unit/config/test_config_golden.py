"""The committed snapshots under tests/golden/ match what conf/ composes today."""
import shutil

from redknot.config import golden


def test_every_suite_hardware_pair_has_a_snapshot():
    names = sorted(p.name for p in golden.GOLDEN_DIR.glob("*.yaml"))
    assert len(names) == 12 * 4  # suites x hardware options
    assert "440k__sm100.yaml" in names and "smoke__cpu.yaml" in names


def test_no_drift():
    problems = golden.drift()
    assert problems == {}, f"resolved config changed; review, then run: {golden.UPDATE_COMMAND}\n{problems}"


def test_a_one_line_yaml_change_is_caught(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(golden.CONF_DIR, conf)
    features = conf / "features" / "default.yaml"
    features.write_text(features.read_text().replace("max_draft: 5 ", "max_draft: 4 "))
    assert golden.drift(conf_dir=conf, only=[("128k", "sm100")]) == {
        "128k__sm100.yaml": "differs from the composed config"}
    assert golden.drift(conf_dir=golden.CONF_DIR, only=[("128k", "sm100")]) == {}


def test_snapshot_shows_the_selected_hardware_and_suite():
    text = (golden.GOLDEN_DIR / "256k__ascend950.yaml").read_text()
    assert text.startswith("# python -m redknot suite=256k hardware=ascend950 --cfg job --resolve\n")
    assert "  name: ascend950\n" in text and "  context_tokens: 262144\n" in text
    assert "  supports_batch_invariant: false\n" in text
