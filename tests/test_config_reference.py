"""The key reference in docs/configuration.md is the one the declarations generate, and every
declared key parses its own default (a new key is declared once, in galaxy/config/keys.py)."""
from galaxy.config.keys import GalaxyConfig, PlanKeys
from galaxy.config.reference import PAGE, page_with_reference
from galaxy.config.schema import declared, default_of, parse
from galaxy.plan import FIELD_OF_KEY


def test_docs_reference_matches_the_declarations():
    with open(PAGE, encoding="utf-8") as f:
        page = f.read()
    assert page == page_with_reference(page), "run: python -m galaxy.config.reference --write"


def test_every_default_parses_as_its_own_type():
    for f, typ in declared(GalaxyConfig):
        default = default_of(f)
        want = f.metadata["null_as"] if default is None and f.metadata["null_as"] is not None else default
        assert parse(f.name, default, typ, f.metadata) == want, f.name


def test_the_plan_reads_exactly_the_plan_section():
    assert {f.name for f, _ in declared(PlanKeys)} == set(FIELD_OF_KEY)
