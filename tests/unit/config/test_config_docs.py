"""The README stays in step with conf/ and the legacy-variable table."""
from redknot.config.hardware_fit import CONF_DIR
from redknot.config.legacy import LEGACY_VARS

README = (CONF_DIR.parent / "README.md").read_text()


def test_every_legacy_variable_has_a_row_naming_its_override_keys():
    rows = {line.split("|")[1].strip(" `"): line for line in README.splitlines() if line.startswith("| `DEEPINFER_")}
    assert set(rows) == {v.name for v in LEGACY_VARS}
    for var in LEGACY_VARS:
        for part in var.replacement.split():
            assert part.split("=")[0] in rows[var.name], (var.name, part)


def test_every_group_option_is_documented():
    for group in ("model", "hardware", "features", "suite", "sweep", "compare"):
        for path in (CONF_DIR / group).glob("*.yaml"):
            assert f"`{path.stem}`" in README, (group, path.stem)
    for path in (CONF_DIR / "hydra" / "launcher").glob("*.yaml"):
        assert f"`{path.stem}`" in README


def test_setup_and_test_commands_match_ci():
    ci = (CONF_DIR.parent / ".ci" / "run").read_text()
    assert 'pip install -e ".[test]" && python -m redknot' in README
    assert '\npytest ' in README and "\npytest\n" in ci
    assert 'python -m pip install -e ".[test]"' in ci and "python -m pip install torch==2.13.0" in ci
